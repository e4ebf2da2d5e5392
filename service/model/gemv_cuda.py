"""The decode GEMV for 1-16 rows in CUDA C (gemv_small.cu), in place of gemv.py's Triton tiles there.

At 8 rows a layer's four GEMVs took 23.4 us for ~7.5 us of weight bytes (H100, run 117). ncu had
them latency-bound (run 103: one 4-warp program an SM, 0.11 eligible warps a scheduler, DRAM at
31%), and none of 512-wide K steps, split-K, L2 prefetches before the PDL wait or 20 KB stages
moved them (runs 74, 78, 103-104). The Triton tile pads the rows to 16, stages W through shared
memory and ldmatrix, with a pipeline's waits between. This kernel reads W and x from global memory
straight into mma fragments (the product transposed: 8 outputs a program, no row of W padded),
W before the PDL wait and x after it, with no shared memory or barrier in its loop; 4 warps split
K. The MLA split kernel's hand-written version (mla_cuda.py) took that kernel's time in the step
from 10.5 to 7.8 us where five Triton reshapings had not.

Run 120 (H100, bench/RESULTS.md): standalone 0.68-0.94x of the Triton GEMV's time at 8 rows and
0.85-1.01x at one; steps 0.99x at batch 1 and 0.97x at 8. The default since.

bf16 only (FP8 rows keep fp8.py's kernel), plain or paired (`gemv_pair` without its norm); built
and launched by nvrtc.py. LATENTSERVE_GEMV_CUDA_MAX_ROWS: up to this many rows (at most 16; 0:
the Triton GEMV throughout, bench/gpu.py's `gemv_cuda_off`).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from . import nvrtc
from .kernel_guard import KernelGuard

GUARD = KernelGuard("gemv_cuda")
SOURCE = Path(__file__).with_name("gemv_small.cu")
OUTPUTS, MAX_ROWS = 8, 16


def max_rows() -> int:
    return min(MAX_ROWS, int(os.environ.get("LATENTSERVE_GEMV_CUDA_MAX_ROWS", "16")))


def k_warps() -> int:
    """Warps a program splitting K (LATENTSERVE_GEMV_CUDA_K_WARPS: 4, or 8 as a candidate, bench/gpu.py's
    `gemv_cuda_k8`). Each warp keeps 8 chunks of 32 in flight, so with 4 a K of 2048 (fused_qkv_a,
    o_proj: 0.45-0.55 of the copy rate at 8 rows in run 120) has half its weights requested before
    the PDL wait and half after; with 8, all of them before."""
    return 8 if os.environ.get("LATENTSERVE_GEMV_CUDA_K_WARPS", "4") == "8" else 4


def _operand_ok(x: torch.Tensor, w: torch.Tensor) -> bool:
    """bf16, K a multiple of 8 and every row 16-byte aligned (the kernel's 16-byte loads)."""
    k = x.shape[1]
    return (x.dtype == w.dtype == torch.bfloat16 and w.dim() == 2 and w.shape[1] == k and k % 8 == 0
            and x.stride(1) == 1 and w.stride(1) == 1 and nvrtc.aligned(x, x.stride(0))
            and nvrtc.aligned(w, w.stride(0)))


def supported(x2: torch.Tensor, weight: torch.Tensor, pair: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
    """x2 [M, K] rows (M up to `max_rows`) against weight [N, K], and pair's (x, weight) into the
    same outputs, on an sm_90 or later GPU (PDL's griddepcontrol)."""
    if GUARD.failure is not None or not 0 < x2.shape[0] <= max_rows() or not nvrtc.runs_on(x2):
        return False
    ops = [(x2, weight)] + ([pair] if pair is not None else [])
    return (all(_operand_ok(a, w) for a, w in ops) and all(a.shape[0] == x2.shape[0] for a, _ in ops)
            and all(w.shape[0] == weight.shape[0] for _, w in ops))


def run(x2: torch.Tensor, weight: torch.Tensor, y: torch.Tensor,
        pair: tuple[torch.Tensor, torch.Tensor] | None = None) -> bool:
    """y [M, N] (bf16, contiguous rows) = x2 @ weight^T (+ pair[0] @ pair[1]^T); False when the
    kernel is off for this process (the caller then launches the Triton one)."""
    return GUARD.call(_launch, x2, weight, y, pair) is not None


def _launch(x2, weight, y, pair) -> bool:
    m, n = y.shape
    xb, wb = pair if pair is not None else (x2, weight)
    warps = k_warps()
    name = ("gemv_small_8" if m <= 8 else "gemv_small_16") + ("_k8" if warps == 8 else "")
    func = nvrtc.function(SOURCE, name, x2.device.index)
    c_i64, c_int = ctypes.c_longlong, ctypes.c_int
    args = [nvrtc.ptr(t) for t in (x2, weight, xb, wb, y)]
    args += [c_i64(s) for s in (x2.stride(0), weight.stride(0), xb.stride(0), wb.stride(0), y.stride(0))]
    args += [c_int(m), c_int(n), c_int(x2.shape[1]), c_int(xb.shape[1]), c_int(int(pair is not None))]
    return nvrtc.launch(func, (-(-n // OUTPUTS), 1, 1), 32 * warps, 0, x2.device, args)
