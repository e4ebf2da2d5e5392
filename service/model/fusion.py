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


def fused(fn):
    compiled = None
    broken = False

    @functools.wraps(fn)
    def call(x: torch.Tensor, *args):
        nonlocal compiled, broken
        if broken or not x.is_cuda or not compile_enabled() or torch.compiler.is_compiling():
            return fn(x, *args)
        if compiled is None:
            _raise_recompile_limit()
            compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        try:
            return compiled(x, *args)
        except Exception as e:  # a compiler failure costs speed, never a request
            broken = True
            log.error("fusion_off", function=fn.__name__, error=f"{type(e).__name__}: {e}"[:500])
            return fn(x, *args)

    call.eager = fn
    return call
