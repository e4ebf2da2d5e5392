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


def compile_enabled() -> bool:
    return os.environ.get("LATENTSERVE_COMPILE", "1") != "0"


def fused(fn):
    compiled = None

    @functools.wraps(fn)
    def call(x: torch.Tensor, *args):
        nonlocal compiled
        if not x.is_cuda or not compile_enabled() or torch.compiler.is_compiling():
            return fn(x, *args)
        if compiled is None:
            compiled = torch.compile(fn, dynamic=True, fullgraph=True)
        return compiled(x, *args)

    call.eager = fn
    return call
