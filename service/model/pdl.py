"""Programmatic dependent launch (PDL) for the decode step's Triton kernels, on Hopper and later.

A decode step is hundreds of small kernels in a CUDA graph, each ~3-10 us on the H200, and
every boundary between two of them costs a launch and a ramp-up in which the next kernel does
nothing. Launched with PDL, a kernel may start while the one before it in the stream is still
finishing: its programs are scheduled early and wait in `griddepcontrol.wait` until the previous
kernel has completed and its writes are visible. Every kernel here calls `enter(PDL)` before it
touches anything a kernel of the step writes (no read of an input still being written, no write
over a buffer the previous kernel still reads), then lets its own dependents launch. Only weights,
which no kernel of a step writes, are read before it: the first weight tile of the GEMVs (bf16 and
FP8), the MoE entry kernel and the MLA absorb kernel, so that load overlaps the previous kernel's tail.
One exception, a candidate: moe_down_early reads what a kernel two back wrote (the step's routing),
which the kernel between has waited for.

Off in the Triton interpreter (no inline PTX), below sm_90, and with LATENTSERVE_PDL=0 (the
bench's baseline).

Our kernels alone linked few boundaries: most of a layer's kernels are Inductor's (norms, rope,
residual adds of the compiled decoder layer) and a PDL kernel after a plain one cannot start
early. `inductor_options` asks Inductor for the same (torch's `triton.enable_pdl`: its kernels
wait before their first load of what the previous kernel wrote, so weight loads go first).
LATENTSERVE_INDUCTOR_PDL=0 keeps Inductor's kernels plain (a bench baseline).
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # CPU-only installs, or a Triton without grid dependency control
    triton = None


def enabled(device: torch.device) -> bool:
    if triton is None or device.type != "cuda" or os.environ.get("LATENTSERVE_PDL", "1") == "0":
        return False
    return _capability(device.index if device.index is not None else torch.cuda.current_device()) >= 9


@functools.cache
def _capability(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


def inductor_options(device: torch.device) -> dict:
    """torch.compile keywords that give Inductor's kernels PDL where ours have it ({} otherwise,
    and on a torch without the option)."""
    if not enabled(device) or os.environ.get("LATENTSERVE_INDUCTOR_PDL", "1") == "0":
        return {}
    import torch._inductor.config as inductor_config

    if not hasattr(inductor_config.triton, "enable_pdl"):
        return {}
    return {"options": {"triton.enable_pdl": True}}


def launch(device: torch.device) -> dict:
    """Launch keywords of a kernel that takes the `PDL` constexpr and calls `enter(PDL)` first."""
    return {"PDL": True, "launch_pdl": True} if enabled(device) else {"PDL": False}


if triton is not None:

    @triton.jit
    def enter(PDL: tl.constexpr):
        if PDL:
            gdc_wait()
            gdc_launch_dependents()
