"""Routed experts with FP8 block-scaled weights above the GEMV limit (decode batches > 16
tokens, prefill): moe_grouped's grouped GEMM (its `align` kernel sorts the (token, slot) pairs
by expert into BLOCK_M row blocks; same grids, so no host sync and CUDA graphs keep it) with
the weight tiles read as FP8. Each BLOCK_K step's FP8 tile is scaled per output column by its
128x128 block's scale in fp32 (BLOCK_K divides the block, so a step never straddles two
scales), rounded to the activation dtype as the torch reference's dequantization rounds, and
accumulated in place on the tensor cores. One byte per weight element read, where dequantizing
the layer's experts first reads one, writes two and reads two again. Scaling each step's
partial product instead kept a second accumulator a tile: 226 registers for gate/up at the
256-token decode tiles (128 now) and 324 bytes spilled at the prefill tiles (none now; sm_90,
Triton 3.6, compiled offline).
"""

from __future__ import annotations

import os

import torch

from ..weights.fp8 import block_of, kernel_operands
from . import act_kernels, moe_grouped, moe_kernels, pdl
from .moe_kernels import ACTS, triton

if triton is not None:
    import triton.language as tl


def supported(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
              act: str) -> bool:
    if not (triton is not None and (x.is_cuda or moe_kernels.INTERPRET) and moe_grouped.enabled() and act in ACTS
            and kernel_operands(x, w13, moe_kernels.INTERPRET) and kernel_operands(x, w2, moe_kernels.INTERPRET)):
        return False
    return k_block(w13, s13, w2, s2) >= 16


def k_block(w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor) -> int:
    """The narrower scale block along K of w13 and w2: the expert kernels' K steps hold whole
    scale blocks or lie inside one, and tl.arange/the reductions want at least 16."""
    return min(block_of(w13, s13)[1], block_of(w2, s2)[1])


if triton is not None:

    @triton.jit
    def _gate_up_fp8_kernel(x_ptr, w13_ptr, s13_ptr, sorted_ptr, block_expert_ptr, used_ptr, h_ptr, num_pairs,
                            width, shard, stride_x, stride_we, stride_wn, stride_se, stride_sn, stride_h, beta,
                            linear_beta, BN: tl.constexpr, BK: tl.constexpr, TOP_K: tl.constexpr,
                            ACT: tl.constexpr, CLIP_UP: tl.constexpr, BLOCK_M: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        pdl.enter(PDL)
        b = tl.program_id(0)
        if b >= tl.load(used_ptr):
            return
        expert = tl.load(block_expert_ptr + b).to(tl.int64)
        rows = b * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + rows)
        valid = pair < num_pairs
        token = (pair // TOP_K).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < shard
        k = tl.arange(0, BLOCK_K)
        dtype = h_ptr.dtype.element_ty
        g_rows = w13_ptr + expert * stride_we + n[None, :].to(tl.int64) * stride_wn
        u_rows = g_rows + shard * stride_wn
        sg_ptr = s13_ptr + expert * stride_se + (n // BN) * stride_sn
        su_ptr = s13_ptr + expert * stride_se + ((n + shard) // BN) * stride_sn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, width, BLOCK_K):
            kmask = k < width - k0
            xv = tl.load(x_ptr + token[:, None] * stride_x + k0 + k[None, :], mask=valid[:, None] & kmask[None, :],
                         other=0.0)
            wmask = kmask[:, None] & nmask[None, :]
            sg = tl.load(sg_ptr + k0 // BK, mask=nmask, other=0.0)
            su = tl.load(su_ptr + k0 // BK, mask=nmask, other=0.0)
            wg = (tl.load(g_rows + k0 + k[:, None], mask=wmask, other=0.0).to(tl.float32) * sg[None, :]).to(dtype)
            wu = (tl.load(u_rows + k0 + k[:, None], mask=wmask, other=0.0).to(tl.float32) * su[None, :]).to(dtype)
            acc_g = tl.dot(xv, wg, acc_g)
            acc_u = tl.dot(xv, wu, acc_u)
        h = act_kernels.gated(acc_g, acc_u, beta, linear_beta, dtype, ACT, CLIP_UP)
        tl.store(h_ptr + rows[:, None].to(tl.int64) * stride_h + n[None, :], h.to(dtype),
                 mask=valid[:, None] & nmask[None, :])

    @triton.jit
    def _down_fp8_kernel(h_ptr, w2_ptr, s2_ptr, sorted_ptr, block_expert_ptr, used_ptr, weights_ptr, part_ptr,
                         num_pairs, width, shard, stride_h, stride_we, stride_wn, stride_se, stride_sn, stride_p,
                         BN: tl.constexpr, BK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        pdl.enter(PDL)
        b = tl.program_id(0)
        if b >= tl.load(used_ptr):
            return
        expert = tl.load(block_expert_ptr + b).to(tl.int64)
        rows = b * BLOCK_M + tl.arange(0, BLOCK_M)
        pair = tl.load(sorted_ptr + rows)
        valid = pair < num_pairs
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < width
        k = tl.arange(0, BLOCK_K)
        dtype = h_ptr.dtype.element_ty
        w_rows = w2_ptr + expert * stride_we + n[None, :].to(tl.int64) * stride_wn
        s_ptr = s2_ptr + expert * stride_se + (n // BN) * stride_sn
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, shard, BLOCK_K):
            kmask = k < shard - k0
            hv = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + k0 + k[None, :],
                         mask=valid[:, None] & kmask[None, :], other=0.0)
            sv = tl.load(s_ptr + k0 // BK, mask=nmask, other=0.0)
            wv = tl.load(w_rows + k0 + k[:, None], mask=kmask[:, None] & nmask[None, :], other=0.0)
            acc = tl.dot(hv, (wv.to(tl.float32) * sv[None, :]).to(dtype), acc)
        y = acc.to(dtype).to(tl.float32) * tl.load(weights_ptr + pair, mask=valid, other=0.0)[:, None]
        tl.store(part_ptr + pair[:, None].to(tl.int64) * stride_p + n[None, :], y,
                 mask=valid[:, None] & nmask[None, :])


def grouped_experts(x, w13, s13, w2, s2, weights, ids, act: str, beta: float, linear_beta: float | None):
    m, width = x.shape
    num_experts, top_k, shard = w13.shape[0], ids.shape[1], w2.shape[2]
    width_out = w2.shape[1]
    out = torch.empty(m, width_out, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    cfg = moe_grouped.config(m, top_k, num_experts)
    cfg.pop("down", None)  # the bf16 kernels' own down shape; FP8's K steps are bound to its scale blocks
    bm, bn = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N")
    bn13, bk13 = block_of(w13, s13)
    bn2, bk2 = block_of(w2, s2)
    # A K step inside one scale block, and at most LATENTSERVE_MOE_FP8_GROUPED_MAX_K (64): FP8's tiles become
    # fp32 registers (sm_90, gate/up at 16 x 64: 92 registers at 64-wide steps, 128 at 128, no spills),
    # and the 128 that bf16 takes from run 112's sweep is untimed here (bench/gpu.py's `fp8_grouped_k128`).
    max_k = int(os.environ.get("LATENTSERVE_MOE_FP8_GROUPED_MAX_K", "64"))
    bk = min(cfg.pop("BLOCK_K"), max_k, bk13, bk2)
    x = x if x.stride(-1) == 1 else x.contiguous()
    weights = weights.contiguous()
    sorted_pairs, block_expert, used = moe_grouped.align(ids, num_experts, bm)
    rows, blocks = sorted_pairs.numel(), block_expert.numel()
    num_pairs = m * top_k
    h = torch.empty(rows, shard, dtype=x.dtype, device=x.device)
    _gate_up_fp8_kernel[(blocks, triton.cdiv(shard, bn))](
        x, w13, s13, sorted_pairs, block_expert, used, h, num_pairs, width, shard, x.stride(0), w13.stride(0),
        w13.stride(1), s13.stride(0), s13.stride(1), h.stride(0), float(beta), float(linear_beta or 1.0),
        BN=bn13, BK=bk13, TOP_K=top_k, ACT=ACTS[act], CLIP_UP=linear_beta is not None, BLOCK_M=bm, BLOCK_N=bn,
        BLOCK_K=bk, **cfg, **pdl.launch(x.device))
    part = torch.empty(num_pairs, width_out, dtype=torch.float32, device=x.device)
    _down_fp8_kernel[(blocks, triton.cdiv(width_out, bn))](
        h, w2, s2, sorted_pairs, block_expert, used, weights, part, num_pairs, width_out, shard, h.stride(0),
        w2.stride(0), w2.stride(1), s2.stride(0), s2.stride(1), part.stride(0), BN=bn2, BK=bk2, BLOCK_M=bm,
        BLOCK_N=bn, BLOCK_K=bk, **cfg, **pdl.launch(h.device))
    return moe_kernels.slot_sum(part, out, top_k)


if triton is not None:

    @torch.library.custom_op("latentserve::fp8_grouped_experts", mutates_args=())
    def fp8_grouped_experts(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor,
                            s2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, act: str, beta: float,
                            linear_beta: float | None) -> torch.Tensor:
        """latentserve::fp8_moe_experts for any M (the grouped GEMM on FP8 tiles)."""
        return grouped_experts(x, w13, s13, w2, s2, weights, ids, act, beta, linear_beta)

    @fp8_grouped_experts.register_fake
    def _(x, w13, s13, w2, s2, weights, ids, act, beta, linear_beta):
        return x.new_empty(x.shape[0], w2.shape[1])
