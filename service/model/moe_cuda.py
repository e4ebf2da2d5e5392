"""The routed experts for a few tokens in CUDA C (expert_small.cu), in place of moe_kernels.py's
Triton `_gate_up_kernel` and `_down_kernel` there (up to 4 tokens: above, the grouped GEMM runs).

At one token a layer's 8 experts take 11.2 us (gate/up) and 7.1 us (down) for 25 and 12.6 MB of
weights, 0.75 and 0.59 of the copy rate (H100, run 117): 5.7 us a layer over their bytes, the
largest excess at batch 1 after the GEMVs. These are the same products on the CUDA C GEMV's tile
(gemv_tile.cuh: weights and x straight into mma fragments, 4 warps splitting K), which took the
GEMVs to 0.68-0.94x of the Triton kernels' time at 8 rows (run 120). Same outputs, roundings and
layout (h [pairs, shard] bf16, the weighted fp32 parts [pairs, width] the slot sum reads).

bf16 only; built and launched by nvrtc.py. LATENTSERVE_MOE_CUDA_MAX_PAIRS: up to this many (token,
slot) pairs (0 by default: a candidate, bench/gpu.py's `moe_cuda`; 32 covers 4 tokens at top-8).
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

import torch

from . import nvrtc
from .kernel_guard import KernelGuard

GUARD = KernelGuard("moe_cuda")
SOURCE = Path(__file__).with_name("expert_small.cu")
OUTPUTS, THREADS = 8, 128


def max_pairs() -> int:
    return int(os.environ.get("LATENTSERVE_MOE_CUDA_MAX_PAIRS", "0"))


def supported(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, pairs: int) -> bool:
    """bf16 x [M, width] and experts w13 [E, 2 * shard, width], w2 [E, width_out, shard], rows
    16-byte aligned, up to `max_pairs` pairs, an sm_90 or later GPU."""
    if GUARD.failure is not None or not 0 < pairs <= max_pairs() or not nvrtc.runs_on(x):
        return False
    width, shard = x.shape[1], w2.shape[2]
    return (x.dtype == w13.dtype == w2.dtype == torch.bfloat16 and w13.dim() == w2.dim() == 3
            and w13.shape[2] == width and w13.shape[1] == 2 * shard and width % 8 == 0 and shard % 8 == 0
            and x.stride(1) == w13.stride(2) == w2.stride(2) == 1 and nvrtc.aligned(x, x.stride(0))
            and nvrtc.aligned(w13, w13.stride(0), w13.stride(1)) and nvrtc.aligned(w2, w2.stride(0), w2.stride(1)))


def run(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
        h: torch.Tensor, part: torch.Tensor, act: int, beta: float, linear_beta: float | None) -> bool:
    """h [pairs, shard] and part [pairs, width_out] as moe_kernels' two kernels fill them (ids and
    weights [M, top_k] contiguous, int64 and fp32; act: act_kernels.ACTS' code); False when the
    kernels are off for this process (the caller then launches the Triton ones)."""
    return GUARD.call(_launch, x, w13, w2, weights, ids, h, part, act, beta, linear_beta) is not None


def _launch(x, w13, w2, weights, ids, h, part, act, beta, linear_beta) -> bool:
    pairs, shard = h.shape
    width_out = part.shape[1]
    c_i64, c_int, c_float = ctypes.c_longlong, ctypes.c_int, ctypes.c_float
    dev = x.device
    gate_up = nvrtc.function(SOURCE, "expert_gate_up_small", dev.index)
    args = [nvrtc.ptr(t) for t in (x, w13, ids, h)]
    args += [c_i64(s) for s in (x.stride(0), w13.stride(0), w13.stride(1), h.stride(0))]
    args += [c_int(x.shape[1]), c_int(shard), c_int(ids.shape[1]), c_float(beta), c_float(linear_beta or 1.0),
             c_int(act), c_int(int(linear_beta is not None))]
    nvrtc.launch(gate_up, (pairs, -(-shard // OUTPUTS), 1), THREADS, 0, dev, args)
    down = nvrtc.function(SOURCE, "expert_down_small", dev.index)
    args = [nvrtc.ptr(t) for t in (h, w2, ids, weights, part)]
    args += [c_i64(s) for s in (h.stride(0), w2.stride(0), w2.stride(1), part.stride(0))]
    args += [c_int(width_out), c_int(shard)]
    return nvrtc.launch(down, (pairs, -(-width_out // OUTPUTS), 1), THREADS, 0, dev, args)
