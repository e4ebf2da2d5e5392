"""The MoE router's expert selection, as a Triton kernel of its own.

`choose` takes one token's fp32 router logits to its experts and their weights: sigmoid or
softmax scores, the correction bias, the group-limited choice (top-2 sum a group, the top
groups), the top-k by repeated argmax, the chosen experts' unbiased scores (normalized). Same
math as moe.route. `select` launches it as a kernel of its own, one program a token (the router's
second kernel, moe_kernels.route). Running it inline in every gate/up program instead, one launch
fewer a layer, was 1.14x slower at batch 8 on the H200 (bench/RESULTS.md, run 43).
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


if triton is not None:

    @triton.jit
    def choose(logits_ptr, bias_ptr, t, stride_l, E: tl.constexpr, E_PAD: tl.constexpr, N_GROUP: tl.constexpr,
               TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, NORM: tl.constexpr,
               SOFTMAX: tl.constexpr, GATHER_W: tl.constexpr = False):
        """Token t's experts [K_PAD] and weights before scaling: scores, bias, groups, top-k.
        GATHER_W: the chosen experts' scores recomputed from their logits, reloaded (from L1) after
        the top-k loop, where each pick otherwise sums its score out of all E (a reduction a pick
        on the selection's dependent chain); the same expression on the same values, so bit-equal."""
        e = tl.arange(0, E_PAD)
        emask = e < E
        logits = tl.load(logits_ptr + t * stride_l + e, mask=emask, other=0.0)
        if SOFTMAX:
            z = tl.where(emask, logits, float("-inf"))
            z_max = tl.max(z, 0)
            z = tl.exp(z - z_max)
            z_sum = tl.sum(z, 0)
            scores = z / z_sum
        else:
            scores = tl.sigmoid(logits)
        bias = tl.load(bias_ptr + e, mask=emask, other=0.0)
        choice = tl.where(emask, scores + bias, float("-inf"))
        if N_GROUP > 1:
            per: tl.constexpr = E_PAD // N_GROUP
            grouped = tl.reshape(choice, [N_GROUP, per])
            col = tl.arange(0, per)
            first = tl.argmax(grouped, 1)
            top1 = tl.max(grouped, 1)
            top2 = tl.max(tl.where(col[None, :] == first[:, None], float("-inf"), grouped), 1)
            gscore = top1 + top2
            g = tl.arange(0, N_GROUP)
            keep = tl.zeros([N_GROUP], tl.int1)
            for _ in tl.static_range(TOPK_GROUP):
                best = tl.argmax(tl.where(keep, float("-inf"), gscore), 0)
                keep = keep | (g == best)
            keep_e = tl.reshape(tl.broadcast_to(keep[:, None], [N_GROUP, per]), [E_PAD])
            choice = tl.where(keep_e, choice, float("-inf"))
        ks = tl.arange(0, K_PAD)
        chosen = tl.zeros([K_PAD], tl.int64)
        w = tl.zeros([K_PAD], tl.float32)
        for j in tl.static_range(TOP_K):
            best = tl.argmax(choice, 0)
            chosen = tl.where(ks == j, best.to(tl.int64), chosen)
            if not GATHER_W:
                w = tl.where(ks == j, tl.sum(tl.where(e == best, scores, 0.0), 0), w)
            choice = tl.where(e == best, float("-inf"), choice)
        if GATHER_W:
            picked = tl.load(logits_ptr + t * stride_l + chosen, mask=ks < TOP_K, other=0.0)
            if SOFTMAX:
                w = tl.exp(picked - z_max) / z_sum
            else:
                w = tl.sigmoid(picked)
            w = tl.where(ks < TOP_K, w, 0.0)
        if NORM:
            w = w / (tl.sum(w, 0) + 1e-20)
        return chosen, w

    @triton.jit
    def _route_select_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_l, scaling,
                             E: tl.constexpr, E_PAD: tl.constexpr, N_GROUP: tl.constexpr,
                             TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                             NORM: tl.constexpr, SOFTMAX: tl.constexpr, GATHER_W: tl.constexpr, PDL: tl.constexpr):
        """Program per token: its experts and weights."""
        pdl.enter(PDL)
        t = tl.program_id(0)
        chosen, w = choose(logits_ptr, bias_ptr, t, stride_l, E, E_PAD, N_GROUP, TOPK_GROUP, TOP_K, K_PAD, NORM,
                            SOFTMAX, GATHER_W)
        ks = tl.arange(0, K_PAD)
        kmask = ks < TOP_K
        tl.store(ids_ptr + t * TOP_K + ks, chosen, mask=kmask)
        tl.store(weights_ptr + t * TOP_K + ks, w * scaling, mask=kmask)


def meta(num_experts: int, n_group: int, topk_group: int, top_k: int, norm_topk_prob: bool, softmax: bool) -> dict:
    """`choose`'s constexprs."""
    return dict(E=num_experts, E_PAD=triton.next_power_of_2(num_experts), N_GROUP=max(1, n_group),
                TOPK_GROUP=max(1, topk_group), TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k),
                NORM=bool(norm_topk_prob), SOFTMAX=bool(softmax))


def launch_options(e_pad: int) -> dict:
    """Warps and the weights' gather. The selection is a chain of ~20 dependent reductions over E
    (group scores, group picks, top-k argmaxes, each pick's score) on one token: latency, not
    work, ~4 us a layer at every batch (run 45). On 4 warps each reduction crosses warps through
    shared memory and barriers; on one (LATENTSERVE_ROUTE_SELECT_WARPS=1, up to 256 experts) it
    is shuffles only. sm_90 PTX at the small preset's 64 experts: 966 instructions and 51
    barriers on 4 warps, 749 and none on one, 643 with GATHER_W too. Kimi-K3's 896 keep 8 warps:
    on one, 32 experts a lane make it 4882-6170 instructions (1844 on 8 with GATHER_W).
    LATENTSERVE_ROUTE_SELECT_GATHER=1: `choose`'s GATHER_W. Both together: 0.98x at batch 1 in runs
    53 and 58, 0.99-1.00x above, inside each run's noise; the defaults since runs 105-106 with the
    other switches of bench/gpu.py's `small_stack_off`. `0` on both: 4 warps, no gather
    (`select_4_warps`)."""
    warps = 4 if e_pad <= 256 else 8
    if e_pad <= 256:
        warps = int(os.environ.get("LATENTSERVE_ROUTE_SELECT_WARPS", "1")) or warps
    return {"num_warps": warps, "GATHER_W": os.environ.get("LATENTSERVE_ROUTE_SELECT_GATHER", "1") == "1"}


def select(logits: torch.Tensor, bias: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, n_group: int,
           topk_group: int, top_k: int, norm_topk_prob: bool, scaling: float, softmax: bool) -> None:
    """Fill weights and ids [M, top_k] from the logits [M, E], one program a token."""
    consts = meta(logits.shape[1], n_group, topk_group, top_k, norm_topk_prob, softmax)
    _route_select_kernel[(logits.shape[0],)](
        logits, bias, weights, ids, logits.stride(0), float(scaling), **consts,
        **launch_options(consts["E_PAD"]), **pdl.launch(logits.device))
