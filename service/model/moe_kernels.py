"""Triton kernels for the MoE of a decode step: routing in two kernels, the routed experts in three.

A decode step on a GPU is launch-bound (bench/RESULTS.md): the torch router runs ~10 kernels and
the grouped-GEMM experts ~15. Here:

- `route`: two kernels: the router GEMV in fp32 (many programs of a few experts each, so the
  router weight streams through many SMs even for one token), then moe_select's kernel, one
  program per token.
- `experts`: for few tokens (M x top_k pairs small), GEMV-shaped kernels that read only the
  chosen experts' rows: (1) each (token, slot) pair's gate and up rows of w13 against the
  token's input, the gated activation (SiLU or SiTU) in the epilogue; (2) each pair's weighted
  down projection in fp32, then (3) each token's sum over its slots in slot order
  (deterministic, no atomics). Roundings follow the torch path: GEMM
  outputs in the activation dtype, the activation as in layers.act_and_mul, the slot sum in fp32.

Both are `torch.library` custom ops, so compiled decoder layers keep them opaque, and they run
inside CUDA graphs (no host sync, shapes fixed by M). Callers check `*_supported` first and
keep the torch path otherwise (CPU, the interpreter aside; shapes the kernels do not take).
"""

from __future__ import annotations

import os

import torch

from . import act_kernels, moe_down_early, moe_select, pdl
from .act_kernels import ACTS
from .kernel_guard import KernelGuard

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
GUARD = KernelGuard("moe_kernels")  # a first-call failure turns the router and expert kernels off


def enabled() -> bool:
    """LATENTSERVE_MOE_KERNELS=0 keeps the torch router and experts (the bench's baseline)."""
    return GUARD.failure is None and os.environ.get("LATENTSERVE_MOE_KERNELS", "1") != "0"


def failure() -> str | None:
    return GUARD.failure


def call(op, *args):
    """`op(*args)`, or None when its first call in this process fails (`KernelGuard`): then the
    caller's torch path runs."""
    return GUARD.call(op, *args)


def gemv_max_tokens() -> int:
    """Up to this many tokens the GEMV experts can run (FP8 experts: do run); above, the grouped
    GEMM, each expert's weights read once for all its tokens. LATENTSERVE_MOE_GEMV_MAX_TOKENS."""
    return int(os.environ.get("LATENTSERVE_MOE_GEMV_MAX_TOKENS", "16"))


def grouped_from_tokens() -> int:
    """From this many tokens 16-bit experts take the grouped GEMM even where the GEMV experts
    could: the GEMV kernels read an expert's weights once a (token, slot) pair, the grouped GEMM
    once for all its tokens. At batch 8 the grouped GEMM's step was 0.96x the GEMV experts' on
    the H200 (run 45, 2026-12-04; their gate/up + down took 62.5 us a layer for 199 MB, 0.76 of
    the copy bandwidth). LATENTSERVE_MOE_GROUPED_FROM_TOKENS (17: the bench's
    `experts_gemv_at_8` baseline, the default before)."""
    return int(os.environ.get("LATENTSERVE_MOE_GROUPED_FROM_TOKENS", "5"))


def _on_device(x: torch.Tensor) -> bool:
    return triton is not None and (x.is_cuda or INTERPRET) and enabled()


def route_max_tokens() -> int:
    """Above this many tokens (prefill) the router's logits go to cuBLAS (the selection stays a
    kernel: `select_supported`). The Triton logits kernel reads the router's weight once per
    token tile and took 0.6 ms a layer for 8 x 1024 tokens on the H200 (14 of 78 ms of the
    prefill). LATENTSERVE_ROUTE_MAX_TOKENS."""
    return int(os.environ.get("LATENTSERVE_ROUTE_MAX_TOKENS", "512"))


def tiled_logits_tokens() -> int:
    """From this many tokens the router's logits come from token tiles on tensor cores: the
    per-token kernel re-reads the weight for every token (14.4 us a layer at 256 tokens on the
    H200, the tiles 5.6; batch 256's step 1.02x, batch 64's 0.99x: run 35, 2026-12-04).
    LATENTSERVE_ROUTE_TILED_TOKENS (a huge value: the bench's `per_token_router` baseline)."""
    return int(os.environ.get("LATENTSERVE_ROUTE_TILED_TOKENS", "128"))


def select_supported(x: torch.Tensor, num_experts: int, n_group: int) -> bool:
    """The selection kernel (`route_select`) at any token count: one program per token, so prefill
    pays ~2 launches for what the torch chain does in ~10 (three top-k's among them: 7.4 of 62 ms
    of device time in the 8 x 1024 prefill on the H200, run 14). LATENTSERVE_ROUTE_SELECT=0 keeps
    the torch chain above route_max_tokens (a bench variant)."""
    return _routable(x, num_experts, n_group) and os.environ.get("LATENTSERVE_ROUTE_SELECT", "1") != "0"


def route_supported(x: torch.Tensor, num_experts: int, n_group: int) -> bool:
    return _routable(x, num_experts, n_group) and x.shape[0] <= route_max_tokens()


def _routable(x: torch.Tensor, num_experts: int, n_group: int) -> bool:
    """The selection kernel's shapes: up to 1024 experts, groups of equal power-of-2 size."""
    pow2 = num_experts & (num_experts - 1) == 0
    return _on_device(x) and num_experts <= 1024 and (n_group <= 1 or (pow2 and num_experts % n_group == 0))


def experts_supported(x: torch.Tensor, act: str) -> bool:
    return _on_device(x) and act in ACTS and x.shape[0] <= gemv_max_tokens()


if triton is not None:

    @triton.jit
    def _router_logits_kernel(x_ptr, w_ptr, logits_ptr, hidden, num_experts, stride_x, stride_w, stride_l,
                              BLOCK_E: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
        """Program (token, block of experts): fp32 logits of BLOCK_E experts over the whole hidden."""
        pdl.enter(PDL)
        t = tl.program_id(0)
        e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        emask = e < num_experts
        acc = tl.zeros([BLOCK_E, BLOCK_H], tl.float32)
        for h0 in range(0, hidden, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            hmask = h < hidden
            xv = tl.load(x_ptr + t * stride_x + h, mask=hmask, other=0.0).to(tl.float32)
            wv = tl.load(w_ptr + e[:, None] * stride_w + h[None, :], mask=emask[:, None] & hmask[None, :],
                         other=0.0).to(tl.float32)
            acc += wv * xv[None, :]
        tl.store(logits_ptr + t * stride_l + e, tl.sum(acc, 1), mask=emask)

    @triton.jit(do_not_specialize=["M"])  # M masks tokens only: no compile per class of a step's count
    def _router_logits_tiled_kernel(x_ptr, w_ptr, logits_ptr, M, hidden, num_experts, stride_x, stride_w, stride_l,
                                    BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                                    IEEE: tl.constexpr, PDL: tl.constexpr):
        """Program (tile of tokens, block of experts): the router's weight is read once per token
        tile, not once per token. 16-bit inputs multiply exactly into the fp32 sums (the logits of
        F.linear(x.float(), w.float()) up to summation order); fp32 inputs take IEEE products."""
        pdl.enter(PDL)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        tmask, emask = t < M, e < num_experts
        acc = tl.zeros([BLOCK_T, BLOCK_E], tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < hidden
            xv = tl.load(x_ptr + t[:, None] * stride_x + k[None, :], mask=tmask[:, None] & kmask[None, :], other=0.0)
            wv = tl.load(w_ptr + e[:, None] * stride_w + k[None, :], mask=emask[:, None] & kmask[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(xv, tl.trans(wv), acc, input_precision="ieee")
            else:
                acc = tl.dot(xv, tl.trans(wv), acc)
        tl.store(logits_ptr + t[:, None] * stride_l + e[None, :], acc, mask=tmask[:, None] & emask[None, :])

    @triton.jit
    def _gate_up_kernel(x_ptr, w13_ptr, ids_ptr, h_ptr, width, shard, stride_x, stride_we, stride_wn, stride_h,
                        beta, linear_beta, TOP_K: tl.constexpr, ACT: tl.constexpr, CLIP_UP: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        pdl.enter(PDL)
        p = tl.program_id(0)  # (token, slot) pair
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < shard
        t = p // TOP_K
        expert = tl.load(ids_ptr + p).to(tl.int64)
        w_rows = w13_ptr + expert * stride_we + n[:, None] * stride_wn
        acc_g = tl.zeros([BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_N], tl.float32)
        for k0 in range(0, width, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < width
            xv = tl.load(x_ptr + t * stride_x + k, mask=kmask, other=0.0).to(tl.float32)
            m2 = nmask[:, None] & kmask[None, :]
            wg = tl.load(w_rows + k[None, :], mask=m2, other=0.0).to(tl.float32)
            wu = tl.load(w_rows + shard * stride_wn + k[None, :], mask=m2, other=0.0).to(tl.float32)
            acc_g += tl.sum(wg * xv[None, :], 1)
            acc_u += tl.sum(wu * xv[None, :], 1)
        dtype = h_ptr.dtype.element_ty
        h = act_kernels.gated(acc_g, acc_u, beta, linear_beta, dtype, ACT, CLIP_UP)
        tl.store(h_ptr + p * stride_h + n, h.to(dtype), mask=nmask)

    @triton.jit
    def _down_kernel(h_ptr, w2_ptr, ids_ptr, weights_ptr, part_ptr, width, shard, stride_h, stride_we, stride_wn,
                     stride_p, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """Program (pair, block of output rows): the weighted down projection of one expert for
        one token, in fp32 (each slot's GEMM output rounded to the activation dtype first)."""
        pdl.enter(PDL)
        p = tl.program_id(0)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < width
        expert = tl.load(ids_ptr + p).to(tl.int64)
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(0, shard, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < shard
            hv = tl.load(h_ptr + p * stride_h + k, mask=kmask, other=0.0).to(tl.float32)
            wv = tl.load(w2_ptr + expert * stride_we + n[:, None] * stride_wn + k[None, :],
                         mask=nmask[:, None] & kmask[None, :], other=0.0).to(tl.float32)
            acc += wv * hv[None, :]
        y = tl.sum(acc, 1).to(h_ptr.dtype.element_ty).to(tl.float32) * tl.load(weights_ptr + p)
        tl.store(part_ptr + p * stride_p + n, y, mask=nmask)

    @triton.jit
    def _slot_sum_kernel(part_ptr, out_ptr, width, stride_p, stride_o, g_ptr, eps, TOP_K: tl.constexpr,
                         BLOCK: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
        """out[t] = sum over the token's slots in slot order (deterministic), in the output dtype.
        NORM (BLOCK covers the row): that sum RMS-normed with weight g, as tail.rms_norm rounds."""
        pdl.enter(PDL)
        t = tl.program_id(0)
        n = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        nmask = n < width
        total = tl.zeros([BLOCK], tl.float32)
        for j in tl.static_range(TOP_K):
            total += tl.load(part_ptr + (t * TOP_K + j) * stride_p + n, mask=nmask, other=0.0)
        dtype = out_ptr.dtype.element_ty
        if NORM:
            xf = total.to(dtype).to(tl.float32)
            inv_rms = tl.rsqrt(tl.sum(xf * xf, 0) / width + eps)
            total = xf * inv_rms * tl.load(g_ptr + n, mask=nmask, other=0.0).to(tl.float32)
        tl.store(out_ptr + t * stride_o + n, total.to(dtype), mask=nmask)


def _route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
           norm_topk_prob: bool, scaling: float, softmax: bool) -> tuple[torch.Tensor, torch.Tensor]:
    weights = torch.empty(x.shape[0], top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(x.shape[0], top_k, dtype=torch.long, device=x.device)
    if x.shape[0]:
        moe_select.select(_logits(x, weight), bias, weights, ids, n_group, topk_group, top_k, norm_topk_prob,
                          scaling, softmax)
    return weights, ids


def _logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    m, hidden = x.shape
    num_experts = weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    logits = torch.empty(m, num_experts, dtype=torch.float32, device=x.device)
    # Many small programs: at one token the router's weight (13 MB at Kimi-K3's 896 x 7168) must
    # still stream through many SMs, not one.
    # 4 experts per program, 1024 of the hidden per load: few dependent loads per program (16
    # experts x 256 per load spent 16 us per layer at batch 1 on the H200, latency-bound).
    if m >= tiled_logits_tokens() and x.dtype == weight.dtype:
        # 16 x 16 tiles (tl.dot's least): at 256 tokens and 64 experts 64 programs, not 4096.
        _router_logits_tiled_kernel[(triton.cdiv(m, 16), triton.cdiv(num_experts, 16))](
            x, weight, logits, m, hidden, num_experts, x.stride(0), weight.stride(0), logits.stride(0),
            BLOCK_T=16, BLOCK_E=16, BLOCK_K=min(256, max(16, triton.next_power_of_2(hidden))),
            IEEE=x.dtype == torch.float32, num_warps=4, num_stages=3, **pdl.launch(x.device))
    else:
        block_h = min(1024, triton.next_power_of_2(hidden))
        _router_logits_kernel[(m, triton.cdiv(num_experts, 4))](
            x, weight, logits, hidden, num_experts, x.stride(0), weight.stride(0), logits.stride(0),
            BLOCK_E=4, BLOCK_H=block_h, num_warps=4, **pdl.launch(x.device))
    return logits


def expert_configs(pairs: int) -> tuple[dict, dict]:
    """Launch shapes of the gate/up and down kernels by (token, slot) pairs: the best of
    bench/gemv.py --sweep on the H200 (small preset, 2026-12-03: 8 pairs 13.0 -> 11.0 us and
    12.6 -> 6.2 us; 64 pairs 41.9 and 24.2 us)."""
    if pairs < 32:
        return ({"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 4, "num_stages": 3},
                {"BLOCK_N": 32, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3})
    return ({"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3},
            {"BLOCK_N": 16, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3})


def _experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
             act: str, beta: float, linear_beta: float | None, sum_slots: bool = True) -> torch.Tensor:
    """sum_slots=False: the weighted fp32 outputs a (token, slot) pair [M * k, W], unsummed."""
    m, width = x.shape
    top_k = ids.shape[1]
    shard = w2.shape[2]
    if m == 0:
        return torch.empty(0, w2.shape[1], dtype=x.dtype if sum_slots else torch.float32, device=x.device)
    x = x if x.stride(-1) == 1 else x.contiguous()
    ids, weights = ids.contiguous(), weights.contiguous()
    h = torch.empty(m * top_k, shard, dtype=x.dtype, device=x.device)
    gate_cfg, down_cfg = expert_configs(m * top_k)
    _gate_up_kernel[(m * top_k, triton.cdiv(shard, gate_cfg["BLOCK_N"]))](
        x, w13, ids, h, width, shard, x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        float(beta), float(linear_beta or 1.0), TOP_K=top_k, ACT=ACTS[act], CLIP_UP=linear_beta is not None,
        **gate_cfg, **pdl.launch(x.device))
    # One program per (pair, 32 output rows), then the slot sum: a token's experts in parallel
    # (looping over them in one program left the kernel latency-bound: 41 us per layer at batch 1).
    width_out = w2.shape[1]
    part = torch.empty(m * top_k, width_out, dtype=torch.float32, device=x.device)
    if moe_down_early.supported(m * top_k, shard):  # its slab before the PDL wait (a candidate)
        moe_down_early.down(h, w2, ids, weights, part)
    else:
        _down_kernel[(m * top_k, triton.cdiv(width_out, down_cfg["BLOCK_N"]))](
            h, w2, ids, weights, part, width_out, shard, h.stride(0), w2.stride(0), w2.stride(1), part.stride(0),
            **down_cfg, **pdl.launch(h.device))
    if not sum_slots:
        return part
    return slot_sum(part, torch.empty(m, width_out, dtype=x.dtype, device=x.device), top_k)


def slot_sum(part: torch.Tensor, out: torch.Tensor, top_k: int,
             norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """out[t] = the sum of part's top_k rows of token t (fp32, then out's dtype); with norm
    (weight, eps) that row RMS-normed, one program a row."""
    m, width_out = out.shape
    block = 1024 if norm is None else triton.next_power_of_2(width_out)
    g, eps = norm if norm is not None else (out, 0.0)  # unread without NORM
    _slot_sum_kernel[(m, triton.cdiv(width_out, block))](part, out, width_out, part.stride(0), out.stride(0), g,
                                                          float(eps), TOP_K=top_k, BLOCK=block, NORM=norm is not None,
                                                          num_warps=4 if block <= 2048 else 8,
                                                          **pdl.launch(part.device))
    return out


def slot_norm_enabled() -> bool:
    """From two rows, at TP 1, the latent MoE's RMS norm in the experts' slot-sum kernel
    (`slot_sum_norm`), where it was a kernel of its own between the slot sum and the paired GEMV
    (MoE._normed_routed): one launch a layer fewer at 2-256 rows, 0.99-1.01x in time (runs 53 and
    58). LATENTSERVE_MOE_SLOT_NORM=0 (bench/gpu.py's `slot_norm_off`) keeps them apart."""
    return os.environ.get("LATENTSERVE_MOE_SLOT_NORM", "1") == "1"


if triton is not None:

    @torch.library.custom_op("latentserve::moe_route", mutates_args=())
    def route(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int,
              top_k: int, norm_topk_prob: bool, scaling: float, softmax: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, H]; router weight [E, H]; bias [E] fp32 -> (weights [M, k] fp32, ids [M, k] int64)."""
        return _route(x, weight, bias, n_group, topk_group, top_k, norm_topk_prob, scaling, softmax)

    @route.register_fake
    def _(x, weight, bias, n_group, topk_group, top_k, norm_topk_prob, scaling, softmax):
        m = x.shape[0]
        return (x.new_empty(m, top_k, dtype=torch.float32), x.new_empty(m, top_k, dtype=torch.long))

    @torch.library.custom_op("latentserve::moe_route_select", mutates_args=())
    def route_select(logits: torch.Tensor, bias: torch.Tensor, n_group: int, topk_group: int, top_k: int,
                     norm_topk_prob: bool, scaling: float, softmax: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """The second half of `route`, from fp32 router logits [M, E] computed elsewhere."""
        m = logits.shape[0]
        weights = torch.empty(m, top_k, dtype=torch.float32, device=logits.device)
        ids = torch.empty(m, top_k, dtype=torch.long, device=logits.device)
        if m:
            moe_select.select(logits, bias, weights, ids, n_group, topk_group, top_k, norm_topk_prob, scaling,
                              softmax)
        return weights, ids

    @route_select.register_fake
    def _(logits, bias, n_group, topk_group, top_k, norm_topk_prob, scaling, softmax):
        m = logits.shape[0]
        return (logits.new_empty(m, top_k, dtype=torch.float32), logits.new_empty(m, top_k, dtype=torch.long))

    @torch.library.custom_op("latentserve::moe_experts", mutates_args=())
    def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                act: str, beta: float, linear_beta: float | None) -> torch.Tensor:
        """x [M, W]; w13 [E, 2*I, W] (gate rows, then up rows); w2 [E, W, I]; weights/ids [M, k].
        Returns sum_j weights[:, j] * w2[ids[:, j]] @ act(w13[ids[:, j]] @ x), [M, W] in x's dtype."""
        return _experts(x, w13, w2, weights, ids, act, beta, linear_beta)

    @experts.register_fake
    def _(x, w13, w2, weights, ids, act, beta, linear_beta):
        return x.new_empty(x.shape[0], w2.shape[1])

    @torch.library.custom_op("latentserve::moe_experts_parts", mutates_args=())
    def experts_parts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      act: str, beta: float, linear_beta: float | None) -> torch.Tensor:
        """`experts` without its slot sum: [M * k, W] fp32, row t * k + j token t's slot j weighted
        (gemv_pair_normed sums them where it reads them: one launch fewer)."""
        return _experts(x, w13, w2, weights, ids, act, beta, linear_beta, sum_slots=False)

    @experts_parts.register_fake
    def _(x, w13, w2, weights, ids, act, beta, linear_beta):
        return x.new_empty(x.shape[0] * ids.shape[1], w2.shape[1], dtype=torch.float32)

    @torch.library.custom_op("latentserve::moe_slot_sum_norm", mutates_args=())
    def slot_sum_norm(parts: torch.Tensor, top_k: int, norm_weight: torch.Tensor, eps: float) -> torch.Tensor:
        """parts [M * k, W] fp32 (`experts_parts`, moe_grouped_experts_parts) -> rms_norm of each
        token's slot sum [M, W] in norm_weight's dtype: the slot sum's roundings, then the norm's."""
        out = torch.empty(parts.shape[0] // top_k, parts.shape[1], dtype=norm_weight.dtype, device=parts.device)
        return slot_sum(parts, out, top_k, norm=(norm_weight, eps)) if out.shape[0] else out

    @slot_sum_norm.register_fake
    def _(parts, top_k, norm_weight, eps):
        return parts.new_empty(parts.shape[0] // top_k, parts.shape[1], dtype=norm_weight.dtype)
