"""Elementwise chains fused by torch.compile (Inductor: one Triton kernel per chain) on CUDA.

A decode step on a GPU is launch-bound: each layer runs ~135 kernels, most of them tiny
elementwise ops (an RMSNorm is 7, rope 10, the router's group-limited top-k ~15). `fused(fn)`
compiles such a pure function once per process (dynamic shapes, so every batch size and width
shares it); CUDA graphs then capture the compiled kernels like any other. CPU tensors keep the
eager function: nothing is launch-bound there and CI needs no compiler. LATENTSERVE_COMPILE=0
turns it off (the bench's baseline).
"""

from __future__ import annotations

import functools
import os

import torch

from ..log import get_logger

log = get_logger("fusion")
# One compiled variant per (dtype, eps, weight or none, rope layout, batch 1 or more): several
# models in one process (tests, bench baselines) pass dynamo's default limit of 8.
_RECOMPILE_LIMIT = 64


def compile_enabled() -> bool:
    return os.environ.get("LATENTSERVE_COMPILE", "1") != "0"


def _raise_recompile_limit() -> None:
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), _RECOMPILE_LIMIT))
            return


def _compiler_errors() -> tuple[type[BaseException], ...]:
    """Failures of the compiler itself; a kernel's runtime error (OOM, bad input) is not one."""
    import torch._dynamo.exc as dynamo_exc

    names = [(dynamo_exc, "TorchDynamoException"), (dynamo_exc, "FailOnRecompileLimitHit")]
    try:
        import torch._inductor.exc as inductor_exc

        names.append((inductor_exc, "InductorError"))
    except ImportError:
        pass
    return tuple(getattr(mod, name) for mod, name in names if hasattr(mod, name))


def fused(fn):
    compiled = None
    broken = False
    errors: tuple[type[BaseException], ...] = ()

    @functools.wraps(fn)
    def call(x: torch.Tensor, *args):
        nonlocal compiled, broken, errors
        if broken or not x.is_cuda or not compile_enabled() or torch.compiler.is_compiling():
            return fn(x, *args)
        if compiled is None:
            _raise_recompile_limit()
            errors = _compiler_errors()
            compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        try:
            return compiled(x, *args)
        except errors as e:  # a compiler failure costs speed, never a request
            broken = True
            log.error("fusion_off", function=fn.__name__, error=f"{type(e).__name__}: {e}"[:500])
            return fn(x, *args)

    call.eager = fn
    return call
