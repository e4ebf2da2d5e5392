"""Routed experts with FP8 block-scaled weights (w13 [E, 2I, W] and w2 [E, W, I] fp8, their
scales [E, 2I/bn, W/bk] and [E, W/bn, I/bk]).

- Decode-sized M on a GPU: FP8 variants of moe_kernels' GEMV experts (gate/up with the gated
  activation, the weighted down projection per (token, slot), the slot sum in slot order),
  reading only the chosen experts' FP8 rows and their block scales.
- More tokens on a GPU: the grouped GEMM on FP8 tiles (fp8_grouped.py).
- Otherwise (CPU; a kernel failure): the layer's experts dequantized to the activation dtype,
  then the bf16 layer's own torch paths (FusedExperts.torch_experts: torch's grouped GEMM, which
  CUDA graphs keep; on CPU the SiLU kernel or batched matmuls). Correct, not fast.
"""

from __future__ import annotations

import torch

from . import act_kernels, fp8, fp8_grouped, moe_kernels, pdl

triton, tl = fp8.triton, (fp8.tl if fp8.triton is not None else None)


def experts(module, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """FusedExperts.forward for FP8 weights: this rank's partial sum over experts [M, W]."""
    w13, w2, s13, s2 = module.w13, module.w2, module.w13_scale_inv, module.w2_scale_inv
    if (moe_kernels.experts_supported(x, module.act_name) and x.dtype in (torch.bfloat16, torch.float16)
            and fp8.triton is not None and fp8_grouped.k_block(w13, s13, w2, s2) >= 16):
        out = moe_kernels.call(torch.ops.latentserve.fp8_moe_experts, x, w13, s13, w2, s2, weights, ids,
                               module.act_name, module.act_beta, module.act_linear_beta)
        if out is not None:
            return out
    if fp8_grouped.supported(x, w13, s13, w2, s2, module.act_name):  # more tokens: grouped GEMM on FP8 tiles
        out = moe_kernels.call(torch.ops.latentserve.fp8_grouped_experts, x, w13, s13, w2, s2, weights, ids,
                               module.act_name, module.act_beta, module.act_linear_beta)
        if out is not None:
            return out
    # No kernel took it: the layer's torch paths on the dequantized weights.
    return module.torch_experts(x, weights, ids, fp8.dequantize(w13, s13, x.dtype), fp8.dequantize(w2, s2, x.dtype))


if triton is not None:

    @triton.jit
    def _gate_up_fp8_kernel(x_ptr, w13_ptr, s13_ptr, ids_ptr, h_ptr, width, shard, stride_x, stride_we, stride_wn,
                            stride_se, stride_sn, stride_h, beta, linear_beta, BN: tl.constexpr, BK: tl.constexpr,
                            TOP_K: tl.constexpr, ACT: tl.constexpr, CLIP_UP: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
                            PDL: tl.constexpr):
        pdl.enter(PDL)
        NB: tl.constexpr = BLOCK_K // SUB  # scale blocks per K step (SUB = min(BK, BLOCK_K))
        p = tl.program_id(0)  # (token, slot) pair
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < shard
        t = p // TOP_K
        expert = tl.load(ids_ptr + p).to(tl.int64)
        w_rows = w13_ptr + expert * stride_we + n[:, None] * stride_wn
        # One scale per row per scale block: partial sums per block, then scaled (a per-element
        # fp32 scale tile would be read 4x the FP8 weight's bytes).
        s_gate = s13_ptr + expert * stride_se + (n // BN) * stride_sn
        s_up = s13_ptr + expert * stride_se + ((n + shard) // BN) * stride_sn
        kblocks = tl.cdiv(width, BK)
        acc_g = tl.zeros([BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_N], tl.float32)
        for k0 in range(0, width, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < width
            xv = tl.load(x_ptr + t * stride_x + k, mask=kmask, other=0.0).to(tl.float32)
            m2 = nmask[:, None] & kmask[None, :]
            wg = tl.load(w_rows + k[None, :], mask=m2, other=0.0).to(tl.float32)
            wu = tl.load(w_rows + shard * stride_wn + k[None, :], mask=m2, other=0.0).to(tl.float32)
            kb = k0 // BK + (tl.arange(0, NB) * SUB) // BK
            smask = nmask[:, None] & (kb < kblocks)[None, :]
            sg = tl.load(s_gate[:, None] + kb[None, :], mask=smask, other=0.0)
            su = tl.load(s_up[:, None] + kb[None, :], mask=smask, other=0.0)
            acc_g += tl.sum(tl.sum(tl.reshape(wg * xv[None, :], [BLOCK_N, NB, SUB]), 2) * sg, 1)
            acc_u += tl.sum(tl.sum(tl.reshape(wu * xv[None, :], [BLOCK_N, NB, SUB]), 2) * su, 1)
        dtype = h_ptr.dtype.element_ty
        h = act_kernels.gated(acc_g, acc_u, beta, linear_beta, dtype, ACT, CLIP_UP)
        tl.store(h_ptr + p * stride_h + n, h.to(dtype), mask=nmask)

    @triton.jit
    def _down_fp8_kernel(h_ptr, w2_ptr, s2_ptr, ids_ptr, weights_ptr, part_ptr, width, shard, stride_h, stride_we,
                         stride_wn, stride_se, stride_sn, stride_p, BN: tl.constexpr, BK: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr, PDL: tl.constexpr):
        pdl.enter(PDL)
        NB: tl.constexpr = BLOCK_K // SUB
        p = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < width
        expert = tl.load(ids_ptr + p).to(tl.int64)
        s_rows = s2_ptr + expert * stride_se + (n // BN) * stride_sn
        kblocks = tl.cdiv(shard, BK)
        acc = tl.zeros([BLOCK_N], tl.float32)
        for k0 in range(0, shard, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < shard
            m2 = nmask[:, None] & kmask[None, :]
            hv = tl.load(h_ptr + p * stride_h + k, mask=kmask, other=0.0).to(tl.float32)
            wv = tl.load(w2_ptr + expert * stride_we + n[:, None] * stride_wn + k[None, :], mask=m2,
                         other=0.0).to(tl.float32)
            kb = k0 // BK + (tl.arange(0, NB) * SUB) // BK
            sv = tl.load(s_rows[:, None] + kb[None, :], mask=nmask[:, None] & (kb < kblocks)[None, :], other=0.0)
            acc += tl.sum(tl.sum(tl.reshape(wv * hv[None, :], [BLOCK_N, NB, SUB]), 2) * sv, 1)
        y = acc.to(h_ptr.dtype.element_ty).to(tl.float32) * tl.load(weights_ptr + p)
        tl.store(part_ptr + p * stride_p + n, y, mask=nmask)


def expert_configs(pairs: int, width: int, shard: int) -> tuple[dict, dict]:
    """Launch shapes of the FP8 gate/up and down kernels: moe_kernels.expert_configs' tiles with
    K steps of as many elements (half the bytes), spanning several scale blocks; one scale block
    per step (128 FP8 bytes a row) left them no faster than bf16 for half the bytes on the H200."""
    cap = lambda k, most: max(16, min(most, triton.next_power_of_2(k)))  # noqa: E731
    if pairs < 32:
        return ({"BLOCK_N": 16, "BLOCK_K": cap(width, 512), "num_warps": 4, "num_stages": 3},
                {"BLOCK_N": 32, "BLOCK_K": cap(shard, 256), "num_warps": 8, "num_stages": 3})
    return ({"BLOCK_N": 32, "BLOCK_K": cap(width, 128), "num_warps": 4, "num_stages": 3},
            {"BLOCK_N": 32, "BLOCK_K": cap(shard, 128), "num_warps": 4, "num_stages": 3})


def _experts(x, w13, s13, w2, s2, weights, ids, act: str, beta: float, linear_beta: float | None) -> torch.Tensor:
    m, width = x.shape
    top_k = ids.shape[1]
    shard = w2.shape[2]
    width_out = w2.shape[1]
    out = torch.empty(m, width_out, dtype=x.dtype, device=x.device)
    if m == 0:
        return out
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids, weights = ids.contiguous(), weights.contiguous()
    bn, bk = fp8.fmt.block_of(w13, s13)
    h = torch.empty(m * top_k, shard, dtype=x.dtype, device=x.device)
    gate_cfg, down_cfg = expert_configs(m * top_k, width, shard)
    _gate_up_fp8_kernel[(m * top_k, triton.cdiv(shard, gate_cfg["BLOCK_N"]))](
        x, w13, s13, ids, h, width, shard, x.stride(0), w13.stride(0), w13.stride(1), s13.stride(0), s13.stride(1),
        h.stride(0), float(beta), float(linear_beta or 1.0), BN=bn, BK=bk, TOP_K=top_k, ACT=moe_kernels.ACTS[act],
        CLIP_UP=linear_beta is not None, SUB=min(bk, gate_cfg["BLOCK_K"]), **gate_cfg, **pdl.launch(x.device))
    bn2, bk2 = fp8.fmt.block_of(w2, s2)
    part = torch.empty(m * top_k, width_out, dtype=torch.float32, device=x.device)
    _down_fp8_kernel[(m * top_k, triton.cdiv(width_out, down_cfg["BLOCK_N"]))](
        h, w2, s2, ids, weights, part, width_out, shard, h.stride(0), w2.stride(0), w2.stride(1), s2.stride(0),
        s2.stride(1), part.stride(0), BN=bn2, BK=bk2, SUB=min(bk2, down_cfg["BLOCK_K"]), **down_cfg,
        **pdl.launch(h.device))
    return moe_kernels.slot_sum(part, out, top_k)


if triton is not None:

    @torch.library.custom_op("latentserve::fp8_moe_experts", mutates_args=())
    def fp8_moe_experts(x: torch.Tensor, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor,
                        weights: torch.Tensor, ids: torch.Tensor, act: str, beta: float,
                        linear_beta: float | None) -> torch.Tensor:
        """moe_kernels.experts with FP8 w13/w2 and their block scales s13/s2."""
        return _experts(x, w13, s13, w2, s2, weights, ids, act, beta, linear_beta)

    @fp8_moe_experts.register_fake
    def _(x, w13, s13, w2, s2, weights, ids, act, beta, linear_beta):
        return x.new_empty(x.shape[0], w2.shape[1])
