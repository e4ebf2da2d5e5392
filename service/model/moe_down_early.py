"""The GEMV experts' down projection with its weights requested before the PDL wait (a candidate,
LATENTSERVE_MOE_DOWN_EARLY; off by default until a GPU run times it).

At one token the experts take ~18 us a layer on the H100 for ~12.6 us of bytes (run 114), and
the down kernel ~7 us for 4.2 (run 103's profile). Its weights depend on the step's routing, so
`moe_kernels._down_kernel` waits on the PDL barrier before it reads any of them. But the routing
comes from two kernels back: under PDL this kernel starts only once every program of the gate/up
kernel before it has passed its own wait, and that wait returned after the route select kernel
had completed and flushed its writes (through any kernel Inductor puts between them: each of the
step's kernels waits before it completes, so a completion implies its predecessors'). So the expert id and the routing weight may be read before
this kernel's wait, and with them the program's whole weight slab: only `h`, the gate/up
kernel's output, waits. The slab's loads then overlap the gate/up kernel's tail.

The ids are read with `.cg` (from L2): an L1 line an earlier layer's read of the same buffer
left on this SM must not answer. The slab lives in registers, so the shard is taken as two
power-of-2 spans (768 = 512 + 256) and only up to 1024 wide. Compiled for sm_90 at 16 rows and 4
warps (bench/triton_ir.py --moe-down-early): 72 registers a thread at 768 wide, 161 at 1024, no
spill.
"""

from __future__ import annotations

import os

import torch

from . import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

MAX_SHARD = 1024


def block_n() -> int:
    """Output rows a program, 0 when off. LATENTSERVE_MOE_DOWN_EARLY: 1 (16 rows, 4 warps) or 32
    (32 rows, 8 warps: the same registers a thread, half the programs)."""
    value = os.environ.get("LATENTSERVE_MOE_DOWN_EARLY", "0")
    return {"0": 0, "1": 16, "16": 16, "32": 32}.get(value, 0)


def supported(pairs: int, shard: int) -> bool:
    """Below 32 (token, slot) pairs: the small-pair launch shapes of moe_kernels.expert_configs."""
    return block_n() > 0 and pairs < 32 and 0 < shard <= MAX_SHARD


def spans(shard: int) -> tuple[int, int]:
    """(K1, K2): K1 the largest power of 2 not above the shard, K2 a power of 2 covering the rest
    (0 where K1 covers it all)."""
    k1 = 1 << (shard.bit_length() - 1)
    rest = shard - k1
    return k1, (1 << (rest - 1).bit_length() if rest else 0)


if triton is not None:

    @triton.jit
    def _slab_dot(h_ptr, k, shard, w):
        hv = tl.load(h_ptr + k, mask=k < shard, other=0.0).to(tl.float32)
        return tl.sum(w.to(tl.float32) * hv[None, :], 1)

    @triton.jit
    def _down_early_kernel(h_ptr, w2_ptr, ids_ptr, weights_ptr, part_ptr, width, shard, stride_h, stride_we,
                           stride_wn, stride_p, BLOCK_N: tl.constexpr, K1: tl.constexpr, K2: tl.constexpr,
                           PDL: tl.constexpr):
        """Program (pair, BLOCK_N output rows): moe_kernels._down_kernel's product, its slab loaded
        before `pdl.enter`."""
        p = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < width
        expert = tl.load(ids_ptr + p, cache_modifier=".cg").to(tl.int64)
        scale = tl.load(weights_ptr + p, cache_modifier=".cg")
        rows = w2_ptr + expert * stride_we + n[:, None] * stride_wn
        k1 = tl.arange(0, K1)
        w1 = tl.load(rows + k1[None, :], mask=nmask[:, None] & (k1 < shard)[None, :], other=0.0)
        if K2 > 0:
            k2 = K1 + tl.arange(0, K2)
            w2 = tl.load(rows + k2[None, :], mask=nmask[:, None] & (k2 < shard)[None, :], other=0.0)
        pdl.enter(PDL)
        h_row = h_ptr + p * stride_h
        acc = _slab_dot(h_row, k1, shard, w1)
        if K2 > 0:
            acc += _slab_dot(h_row, k2, shard, w2)
        # Each slot's GEMM output rounded to the activation dtype first, as the torch path does.
        y = acc.to(h_ptr.dtype.element_ty).to(tl.float32) * scale
        tl.store(part_ptr + p * stride_p + n, y, mask=nmask)


def down(h: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, part: torch.Tensor) -> None:
    """part[p] = weights[p] * (w2[ids[p]] @ h[p]) in fp32 for every (token, slot) pair p; ids and
    weights contiguous [M, k], h [M * k, shard], part [M * k, W]."""
    width, shard = w2.shape[1], w2.shape[2]
    rows = block_n()
    k1, k2 = spans(shard)
    _down_early_kernel[(h.shape[0], triton.cdiv(width, rows))](
        h, w2, ids, weights, part, width, shard, h.stride(0), w2.stride(0), w2.stride(1), part.stride(0),
        BLOCK_N=rows, K1=k1, K2=k2, num_warps=4 if rows == 16 else 8, **pdl.launch(h.device))
