"""Triton grouped GEMM for the routed experts above the GEMV limit (decode batches > 16 tokens,
and prefill): four kernels, no host sync, no atomics, no torch sort (issue 12).

1. `_align_kernel`, one program per expert: from the router's ids [M, k], each expert's rows
   padded to a multiple of BLOCK_M in `sorted_pairs` (pair = token * k + slot, grouped by
   expert, pair order kept within an expert, padding rows = M*k), the expert of each BLOCK_M
   block and the number of blocks used. It replaces the torch path's argsort (9% of a batch-64
   step on the H200, bench/RESULTS.md), counts, cumsum and gathers.
   Up to `align_in_max_pairs` pairs (128 by default), gate/up's programs lay out their own blocks
   instead (`_block_rows`), and the align kernel is not launched.
2. `_gate_up_kernel`: one program per (row block, N block): the block's token rows of x
   (gathered through sorted_pairs) against the expert's gate and up tiles of w13 on tensor
   cores, fp32 accumulation, the gated activation (SiLU or Kimi's SiTU) in the epilogue.
3. `_down_kernel`: the block's activations against w2; the output, rounded to the activation
   dtype like a GEMM's, times the routing weight in fp32, is written per (token, slot) pair.
4. moe_kernels' slot sum: each token's k pairs summed in slot order (deterministic).

Roundings follow FusedExperts.grouped (GEMM outputs in the activation dtype, the activation as
layers.act_and_mul, the slot sum in fp32). Grids are sized for the worst case (M*k rows plus
BLOCK_M - 1 padding rows per expert); programs past the used blocks exit at once, so the shapes
depend on M only and the op runs inside CUDA graphs. Block sizes come from `CONFIGS`.

FP8 weights (128x128 block scales) fit later as a constexpr switch in the two GEMM kernels: load
the fp8 tile, scale each BLOCK_K step's partial product by its block's scale (BLOCK_K divides 128,
BLOCK_N <= 128), accumulate in fp32 as now.
"""

from __future__ import annotations

import os

import torch

from . import act_kernels, moe_kernels, pdl
from .moe_kernels import ACTS, INTERPRET, triton

if triton is not None:
    import triton.language as tl

# Block sizes by mean (token, slot) pairs per expert, M * top_k / E (the token count scaled to the
# model: what decides how many row blocks read an expert's weight tiles). Decode is bandwidth-bound:
# BLOCK_M should hold most experts' rows so each weight tile is read once, and 64-128-wide K steps
# in 4 stages keep 1-3 programs per SM, one program's start hiding behind another's stream. Prefill
# is compute-bound: big tiles. Rows: (up to this many pairs per expert, BLOCK_M, BLOCK_N,
# BLOCK_K, num_warps, num_stages). Retune with bench/moe_grouped.py --sweep;
# LATENTSERVE_MOE_GROUPED_CONFIG="16,64,64,4,4" overrides the table.
CONFIGS: list[tuple[float, int, int, int, int, int]] = [
    # small preset (64 experts, top 8): M <= 192 (8 rows per expert at 64). 16-row blocks in 128-wide K
    # steps, the sweeps' best at M = 8, 16, 64 and 128 (runs 112 and 115, H100, 2026-12-07). The rows
    # before (16 x 64 x 64 up to 96 pairs, 32 x 64 x 64 up to 192): 76.0 against 72.4 us at M=8; at 64
    # and 128 not among the 8 best (over 117.3 and 121.3 us, against 114.0 and 118.6). The step: 0.98x
    # at batches 8 and 64 against the row before (run 113).
    (24, 16, 64, 128, 4, 4),
    (64, 64, 64, 64, 4, 4),   # M <= 512: wgmma-sized row blocks
    # Prefill: bench/moe_grouped.py --m 8192 --sweep on the H200 (2026-12-03, run 15): 920 us a
    # layer (336 TFLOP/s) against 1156 us for (128, 64, 64, 8, 4), the best of 10 prefill tiles.
    (float("inf"), 128, 128, 64, 8, 3),
]


def enabled() -> bool:
    """LATENTSERVE_MOE_GROUPED=torch keeps torch._grouped_mm (the bench's baseline)."""
    return os.environ.get("LATENTSERVE_MOE_GROUPED", "triton") != "torch" and moe_kernels.enabled()


def max_tokens() -> int | None:
    """Above this many tokens FusedExperts hands prefill to torch._grouped_mm's CUTLASS kernels
    (bf16 on sm_90/sm_100); None: never. Measured on the H200, 8 x 1024-token prefill of `small`
    (bench/gpu.py's prefill variants): the Triton kernels at every size took 0.94x (run 10) and
    0.86x (run 12, 67.7 against 78.4 ms) of the step with torch._grouped_mm above 1024 tokens,
    which also pays a gather, a scatter and a weights multiply around it.
    LATENTSERVE_MOE_GROUPED_MAX_TOKENS=1024 is that baseline."""
    value = os.environ.get("LATENTSERVE_MOE_GROUPED_MAX_TOKENS")
    return None if value is None else int(value)


def supported(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, act: str) -> bool:
    """CUDA (or the interpreter), bf16/fp16 activations and weights of the same dtype, a gated
    activation the kernels know, weights contiguous along their reduction dims."""
    # Interpreted (CPU tests): fp16 only, the interpreter's tl.dot does not take bf16.
    on_device = x.is_cuda or (INTERPRET and x.dtype == torch.float16)
    return (triton is not None and on_device and enabled() and act in ACTS
            and x.dtype in (torch.bfloat16, torch.float16) and w13.dtype == x.dtype == w2.dtype
            and x.dim() == 2 and w13.stride(-1) == 1 and w2.stride(-1) == 1)


DOWN_KEYS = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


def config(tokens: int, top_k: int, num_experts: int) -> dict:
    """Both kernels' launch shape; "down": the down kernel's own (BLOCK_N, BLOCK_K, warps, stages)
    where LATENTSERVE_MOE_GROUPED_DOWN_CONFIG="128,64,4,4" sets one (it shares BLOCK_M, the
    alignment's), to be swept apart from gate/up: its N is the model width (1024), not the shard
    (2 x 768), and its K the shard (bench/moe_grouped.py --sweep, not yet run on a GPU)."""
    env = os.environ.get("LATENTSERVE_MOE_GROUPED_CONFIG")
    if env:
        row = (0, *map(int, env.split(",")))
    else:
        per_expert = tokens * top_k / max(1, num_experts)
        row = next(r for r in CONFIGS if per_expert <= r[0])
    cfg = dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"), row[1:]))
    down = os.environ.get("LATENTSERVE_MOE_GROUPED_DOWN_CONFIG")
    if down:
        cfg["down"] = dict(zip(DOWN_KEYS, map(int, down.split(","))))
    return cfg


def align_in_max_pairs() -> int:
    """LATENTSERVE_MOE_ALIGN_IN_MAX_PAIRS (0: off): up to this many (token, slot) pairs, each
    gate/up program finds its row block's expert and pairs from the router's ids itself
    (`_block_rows`, what `_align_kernel` writes for that block) and the align kernel is not
    launched: one kernel a layer fewer where the grouped GEMM runs. Every program reads all the
    ids, so it is for few pairs: 128 is 16 tokens at top 8. The default since run 70 (H100,
    2026-12-06): `small` at batch 8 20.0 -> 19.1 kernels a layer at 0.99x the step time, its
    kernel and engine tests passing on the GPU (runs 69, 73)."""
    return int(os.environ.get("LATENTSERVE_MOE_ALIGN_IN_MAX_PAIRS", "128"))


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks of the worst routing: every pair, plus a partial block per expert that got any."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m)


if triton is not None:

    @triton.jit
    def _align_kernel(ids_ptr, sorted_ptr, block_expert_ptr, used_ptr, num_pairs,
                      BINS: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr, PDL: tl.constexpr):
        """Program per expert. Each counts every expert's pairs (a histogram of all M*k ids, a few
        KB from L2, repeated per program), so it knows its first row (the padded counts of the
        experts before it); then it writes its own pairs in pair order (a prefix sum of its
        matches), its padding rows and its blocks' expert. No program reads what another
        writes: no atomics, no barriers, the same result every time."""
        pdl.enter(PDL)
        expert = tl.program_id(0)
        c = tl.arange(0, CHUNK)
        counts = tl.zeros([BINS], tl.int32)
        for p0 in range(0, num_pairs, CHUNK):
            valid = p0 + c < num_pairs
            ids = tl.load(ids_ptr + p0 + c, mask=valid, other=0).to(tl.int32)
            counts += tl.histogram(ids, BINS, mask=valid)
        bins = tl.arange(0, BINS)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        start = tl.sum(tl.where(bins < expert, padded, 0), 0)
        count = tl.sum(tl.where(bins == expert, counts, 0), 0)
        rows = tl.sum(tl.where(bins == expert, padded, 0), 0)
        if expert == 0:
            tl.store(used_ptr, tl.sum(padded, 0) // BLOCK_M)
        if count > 0:
            row = start
            for p0 in range(0, num_pairs, CHUNK):
                p = p0 + c
                hit = (tl.load(ids_ptr + p, mask=p < num_pairs, other=-1) == expert).to(tl.int32)
                tl.store(sorted_ptr + row + tl.cumsum(hit, 0) - hit, p, mask=hit != 0)
                row += tl.sum(hit, 0)
            j = tl.arange(0, BLOCK_M)  # padding rows, marked num_pairs
            tl.store(sorted_ptr + start + count + j, tl.zeros([BLOCK_M], tl.int32) + num_pairs, mask=j < rows - count)
            nblocks = rows // BLOCK_M
            for b0 in range(0, nblocks, CHUNK):
                blk = b0 + c
                tl.store(block_expert_ptr + start // BLOCK_M + blk, tl.zeros([CHUNK], tl.int32) + expert,
                         mask=blk < nblocks)


    @triton.jit
    def _block_rows(ids_ptr, num_pairs, b, BINS: tl.constexpr, BLOCK_M: tl.constexpr, PAIRS: tl.constexpr):
        """Row block b of the expert-grouped order from all num_pairs (<= PAIRS) router ids: (blocks
        used, b's expert, b's pairs [BLOCK_M] with num_pairs on padding rows), as _align_kernel
        lays them out. b's expert is the first whose blocks end past b; its pairs are that
        expert's pairs of rank (b - its first block) * BLOCK_M + j, ranks in pair order."""
        p = tl.arange(0, PAIRS)
        pvalid = p < num_pairs
        ids = tl.load(ids_ptr + p, mask=pvalid, other=-1).to(tl.int32)
        blocks = (tl.histogram(tl.where(pvalid, ids, 0), BINS, mask=pvalid) + BLOCK_M - 1) // BLOCK_M
        ends = tl.cumsum(blocks, 0)
        expert = tl.sum((ends <= b).to(tl.int32), 0)
        first = tl.sum(tl.where(tl.arange(0, BINS) < expert, blocks, 0), 0)
        hit = (ids == expert).to(tl.int32)
        rank = tl.cumsum(hit, 0) - hit
        j = (b - first) * BLOCK_M + tl.arange(0, BLOCK_M)
        match = (hit[None, :] != 0) & (rank[None, :] == j[:, None])
        pair = tl.sum(tl.where(match, p[None, :], 0), 1)
        pair = tl.where(tl.sum(match.to(tl.int32), 1) > 0, pair, num_pairs)
        return tl.sum(blocks, 0), expert, pair

    @triton.jit
    def _gate_up_kernel(x_ptr, w13_ptr, ids_ptr, sorted_ptr, block_expert_ptr, used_ptr, h_ptr, num_pairs, width,
                        shard, stride_x, stride_we, stride_wn, stride_h, beta, linear_beta,
                        TOP_K: tl.constexpr, ACT: tl.constexpr, CLIP_UP: tl.constexpr, IEEE: tl.constexpr,
                        EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PDL: tl.constexpr, ALIGN_PAIRS: tl.constexpr = 0, BINS: tl.constexpr = 32):
        """Program (row block, N block): h[rows, n] = act(x[tokens] @ gate[e, n]^T, x[tokens] @ up[e, n]^T),
        rows in sorted (expert-grouped) order. ALIGN_PAIRS (`align_in_max_pairs`): the block's
        rows from the ids here, which the programs of N block 0 write for the down kernel."""
        pdl.enter(PDL)
        b = tl.program_id(0)
        rows = b * BLOCK_M + tl.arange(0, BLOCK_M)
        if ALIGN_PAIRS:
            used, expert, pair = _block_rows(ids_ptr, num_pairs, b, BINS, BLOCK_M, ALIGN_PAIRS)
            if b >= used:
                return
            if tl.program_id(1) == 0:
                tl.store(sorted_ptr + rows, pair)
                tl.store(block_expert_ptr + b, expert)
                if b == 0:
                    tl.store(used_ptr, used)
            expert = expert.to(tl.int64)
        else:
            if b >= tl.load(used_ptr):
                return
            expert = tl.load(block_expert_ptr + b).to(tl.int64)
            pair = tl.load(sorted_ptr + rows)
        valid = pair < num_pairs
        token = (pair // TOP_K).to(tl.int64)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < shard
        k = tl.arange(0, BLOCK_K)
        x_ptrs = x_ptr + token[:, None] * stride_x + k[None, :]
        g_ptrs = w13_ptr + expert * stride_we + n[None, :].to(tl.int64) * stride_wn + k[:, None]
        u_ptrs = g_ptrs + shard * stride_wn
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, width, BLOCK_K):
            if EVEN_K:
                xv = tl.load(x_ptrs, mask=valid[:, None], other=0.0)
                if EVEN_N:
                    wg = tl.load(g_ptrs)
                    wu = tl.load(u_ptrs)
                else:
                    wg = tl.load(g_ptrs, mask=nmask[None, :], other=0.0)
                    wu = tl.load(u_ptrs, mask=nmask[None, :], other=0.0)
            else:
                kmask = k < width - k0
                xv = tl.load(x_ptrs, mask=valid[:, None] & kmask[None, :], other=0.0)
                wg = tl.load(g_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
                wu = tl.load(u_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
            if IEEE:
                acc_g = tl.dot(xv, wg, acc_g, input_precision="ieee")
                acc_u = tl.dot(xv, wu, acc_u, input_precision="ieee")
            else:
                acc_g = tl.dot(xv, wg, acc_g)
                acc_u = tl.dot(xv, wu, acc_u)
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        dtype = h_ptr.dtype.element_ty
        h = act_kernels.gated(acc_g, acc_u, beta, linear_beta, dtype, ACT, CLIP_UP)
        tl.store(h_ptr + rows[:, None].to(tl.int64) * stride_h + n[None, :], h.to(dtype),
                 mask=valid[:, None] & nmask[None, :])

    @triton.jit
    def _down_kernel(h_ptr, w2_ptr, sorted_ptr, block_expert_ptr, used_ptr, weights_ptr, part_ptr, num_pairs,
                     width, shard, stride_h, stride_we, stride_wn, stride_p,
                     IEEE: tl.constexpr, EVEN_K: tl.constexpr, EVEN_N: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """Program (row block, N block of the output width): part[pair, n] = weight[pair] *
        (h[rows] @ w2[e, n]^T), the GEMM output rounded to the activation dtype, then fp32."""
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
        h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_h + k[None, :]
        w_ptrs = w2_ptr + expert * stride_we + n[None, :].to(tl.int64) * stride_wn + k[:, None]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, shard, BLOCK_K):
            if EVEN_K:
                hv = tl.load(h_ptrs, mask=valid[:, None], other=0.0)
                if EVEN_N:
                    wv = tl.load(w_ptrs)
                else:
                    wv = tl.load(w_ptrs, mask=nmask[None, :], other=0.0)
            else:
                kmask = k < shard - k0
                hv = tl.load(h_ptrs, mask=valid[:, None] & kmask[None, :], other=0.0)
                wv = tl.load(w_ptrs, mask=kmask[:, None] & nmask[None, :], other=0.0)
            if IEEE:
                acc = tl.dot(hv, wv, acc, input_precision="ieee")
            else:
                acc = tl.dot(hv, wv, acc)
            h_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        y = acc.to(h_ptr.dtype.element_ty).to(tl.float32)
        y = y * tl.load(weights_ptr + pair, mask=valid, other=0.0)[:, None]
        tl.store(part_ptr + pair[:, None].to(tl.int64) * stride_p + n[None, :], y,
                 mask=valid[:, None] & nmask[None, :])


def histogram_bins(num_experts: int) -> int:
    """Triton's histogram keeps at least one bin per lane of a warp."""
    return max(32, triton.next_power_of_2(num_experts))


def _layout_buffers(num_pairs: int, num_experts: int, block_m: int, device) -> tuple:
    blocks = max_blocks(num_pairs, num_experts, block_m)
    return (torch.empty(blocks * block_m, dtype=torch.int32, device=device),
            torch.empty(blocks, dtype=torch.int32, device=device), torch.empty(1, dtype=torch.int32, device=device))


def align(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids [M, k] -> (sorted_pairs [max rows] int32, expert_of_block [max blocks] int32, used blocks [1]
    int32). Rows past used * block_m and blocks past used are left unwritten."""
    num_pairs = ids.numel()
    sorted_pairs, block_expert, used = _layout_buffers(num_pairs, num_experts, block_m, ids.device)
    chunk = min(4096, max(256, triton.next_power_of_2(num_pairs)))
    _align_kernel[(num_experts,)](ids.contiguous().view(-1), sorted_pairs, block_expert, used, num_pairs,
                                  BINS=histogram_bins(num_experts), BLOCK_M=block_m, CHUNK=chunk, num_warps=4 if chunk <= 1024 else 8,
                                  **pdl.launch(ids.device))
    return sorted_pairs, block_expert, used


def grouped_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                    act: str, beta: float, linear_beta: float | None, cfg: dict | None = None,
                    sum_slots: bool = True) -> torch.Tensor:
    """sum_slots=False: the weighted fp32 outputs a (token, slot) pair [M * k, W], unsummed."""
    m, width = x.shape
    num_experts, top_k, shard = w13.shape[0], ids.shape[1], w2.shape[2]
    width_out = w2.shape[1]
    if m == 0:
        return torch.empty(0, width_out, dtype=x.dtype if sum_slots else torch.float32, device=x.device)
    cfg = dict(cfg or config(m, top_k, num_experts))
    bm, bn, bk = cfg.pop("BLOCK_M"), cfg.pop("BLOCK_N"), cfg.pop("BLOCK_K")
    own = cfg.pop("down", {})
    down = {"BLOCK_N": bn, "BLOCK_K": bk, **cfg, **own}
    dn, dk = down.pop("BLOCK_N"), down.pop("BLOCK_K")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weights = weights.contiguous()
    num_pairs = m * top_k
    in_kernel = num_pairs <= align_in_max_pairs()
    if in_kernel:  # gate/up's programs write these
        sorted_pairs, block_expert, used = _layout_buffers(num_pairs, num_experts, bm, x.device)
        ids = ids.contiguous().view(-1)
    else:
        sorted_pairs, block_expert, used = align(ids, num_experts, bm)
    rows, blocks = sorted_pairs.numel(), block_expert.numel()
    ieee = x.dtype == torch.float32
    h = torch.empty(rows, shard, dtype=x.dtype, device=x.device)
    _gate_up_kernel[(blocks, triton.cdiv(shard, bn))](
        x, w13, ids, sorted_pairs, block_expert, used, h, num_pairs, width, shard,
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0), float(beta), float(linear_beta or 1.0),
        TOP_K=top_k, ACT=ACTS[act], CLIP_UP=linear_beta is not None, IEEE=ieee, EVEN_K=width % bk == 0,
        EVEN_N=shard % bn == 0, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
        ALIGN_PAIRS=max(16, triton.next_power_of_2(num_pairs)) if in_kernel else 0,
        BINS=histogram_bins(num_experts), **cfg, **pdl.launch(x.device))
    part = torch.empty(num_pairs, width_out, dtype=torch.float32, device=x.device)
    _down_kernel[(blocks, triton.cdiv(width_out, dn))](
        h, w2, sorted_pairs, block_expert, used, weights, part, num_pairs, width_out, shard,
        h.stride(0), w2.stride(0), w2.stride(1), part.stride(0),
        IEEE=ieee, EVEN_K=shard % dk == 0, EVEN_N=width_out % dn == 0, BLOCK_M=bm, BLOCK_N=dn, BLOCK_K=dk, **down,
        **pdl.launch(h.device))
    if not sum_slots:
        return part
    return moe_kernels.slot_sum(part, torch.empty(m, width_out, dtype=x.dtype, device=x.device), top_k)


if triton is not None:

    @torch.library.custom_op("latentserve::moe_grouped_experts", mutates_args=())
    def experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                act: str, beta: float, linear_beta: float | None) -> torch.Tensor:
        """As latentserve::moe_experts (same arguments, same result and roundings), for any M."""
        return grouped_experts(x, w13, w2, weights, ids, act, beta, linear_beta)

    @experts.register_fake
    def _(x, w13, w2, weights, ids, act, beta, linear_beta):
        return x.new_empty(x.shape[0], w2.shape[1])

    @torch.library.custom_op("latentserve::moe_grouped_experts_parts", mutates_args=())
    def experts_parts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                      act: str, beta: float, linear_beta: float | None) -> torch.Tensor:
        """`experts` without its slot sum, as latentserve::moe_experts_parts: [M * k, W] fp32."""
        return grouped_experts(x, w13, w2, weights, ids, act, beta, linear_beta, sum_slots=False)

    @experts_parts.register_fake
    def _(x, w13, w2, weights, ids, act, beta, linear_beta):
        return x.new_empty(x.shape[0] * ids.shape[1], w2.shape[1], dtype=torch.float32)
