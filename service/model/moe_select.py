"""The MoE router's expert selection, as a Triton kernel of its own.

`choose` takes a block of tokens' fp32 router logits to their experts and weights: sigmoid or
softmax scores, the correction bias, the group-limited choice (top-2 sum a group, the top
groups), the top-k by repeated argmax, the chosen experts' unbiased scores (normalized). Same
math as moe.route; every reduction runs along the experts' axis, so a block of tokens takes
one token's dependent chain. `select` launches it as a kernel of its own, one program a token (the router's
second kernel, moe_kernels.route). Running it inline in every gate/up program instead, one launch
fewer a layer, was 1.14x slower at batch 8 on the H200 (bench/RESULTS.md, run 43).
`choose_if_last` runs it once a row block, in the last of the MoE entry kernel's router programs
(LATENTSERVE_ROUTE_IN_ENTRY=N: up to N rows, a candidate).
"""

from __future__ import annotations

import os

import torch

from . import pdl
from .counters import ArrivalCounters
from .kernel_guard import KernelGuard

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


if triton is not None:

    @triton.jit
    def choose(logits_ptr, bias_ptr, m, mmask, stride_l, BLOCK_M: tl.constexpr, E: tl.constexpr,
                    E_PAD: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                    K_PAD: tl.constexpr, NORM: tl.constexpr, SOFTMAX: tl.constexpr, GATHER_W: tl.constexpr = False):
        """Rows m's experts [BLOCK_M, K_PAD] and weights before scaling: scores, bias, groups,
        top-k, every reduction along the experts' axis, so BLOCK_M tokens take one token's chain.
        GATHER_W: the chosen experts' scores recomputed from their logits, reloaded (from L1) after
        the top-k loop, where each pick otherwise sums its score out of all E (a reduction a pick
        on the selection's dependent chain); the same expression on the same values, so bit-equal."""
        e = tl.arange(0, E_PAD)
        emask = e < E
        rows = logits_ptr + m[:, None] * stride_l
        logits = tl.load(rows + e[None, :], mask=mmask[:, None] & emask[None, :], other=0.0)
        if SOFTMAX:
            z = tl.where(emask[None, :], logits, float("-inf"))
            z_max = tl.max(z, 1)
            z = tl.exp(z - z_max[:, None])
            z_sum = tl.sum(z, 1)
            scores = z / z_sum[:, None]
        else:
            scores = tl.sigmoid(logits)
        bias = tl.load(bias_ptr + e, mask=emask, other=0.0)
        choice = tl.where(emask[None, :], scores + bias[None, :], float("-inf"))
        if N_GROUP > 1:
            per: tl.constexpr = E_PAD // N_GROUP
            grouped = tl.reshape(choice, [BLOCK_M, N_GROUP, per])
            col = tl.arange(0, per)
            first = tl.argmax(grouped, 2)
            top1 = tl.max(grouped, 2)
            top2 = tl.max(tl.where(col[None, None, :] == first[:, :, None], float("-inf"), grouped), 2)
            gscore = top1 + top2
            g = tl.arange(0, N_GROUP)
            keep = tl.zeros([BLOCK_M, N_GROUP], tl.int1)
            for _ in tl.static_range(TOPK_GROUP):
                best = tl.argmax(tl.where(keep, float("-inf"), gscore), 1)
                keep = keep | (g[None, :] == best[:, None])
            keep_e = tl.reshape(tl.broadcast_to(keep[:, :, None], [BLOCK_M, N_GROUP, per]), [BLOCK_M, E_PAD])
            choice = tl.where(keep_e, choice, float("-inf"))
        ks = tl.arange(0, K_PAD)
        chosen = tl.zeros([BLOCK_M, K_PAD], tl.int64)
        w = tl.zeros([BLOCK_M, K_PAD], tl.float32)
        for j in tl.static_range(TOP_K):
            best = tl.argmax(choice, 1)
            chosen = tl.where(ks[None, :] == j, best[:, None].to(tl.int64), chosen)
            if not GATHER_W:
                w = tl.where(ks[None, :] == j, tl.sum(tl.where(e[None, :] == best[:, None], scores, 0.0), 1)[:, None], w)
            choice = tl.where(e[None, :] == best[:, None], float("-inf"), choice)
        if GATHER_W:
            kmask = mmask[:, None] & (ks < TOP_K)[None, :]
            picked = tl.load(rows + chosen, mask=kmask, other=0.0)
            if SOFTMAX:
                w = tl.exp(picked - z_max[:, None]) / z_sum[:, None]
            else:
                w = tl.sigmoid(picked)
            w = tl.where(kmask, w, 0.0)
        if NORM:
            w = w / (tl.sum(w, 1)[:, None] + 1e-20)
        return chosen, w

    @triton.jit
    def _route_select_kernel(logits_ptr, bias_ptr, weights_ptr, ids_ptr, stride_l, scaling,
                             E: tl.constexpr, E_PAD: tl.constexpr, N_GROUP: tl.constexpr,
                             TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
                             NORM: tl.constexpr, SOFTMAX: tl.constexpr, GATHER_W: tl.constexpr, PDL: tl.constexpr):
        """Program per token: its experts and weights."""
        pdl.enter(PDL)
        m = tl.program_id(0) + tl.arange(0, 1)
        mmask = tl.full([1], 1, tl.int1)
        chosen, w = choose(logits_ptr, bias_ptr, m, mmask, stride_l, 1, E, E_PAD, N_GROUP, TOPK_GROUP, TOP_K,
                                K_PAD, NORM, SOFTMAX, GATHER_W)
        _store(weights_ptr, ids_ptr, m, mmask, chosen, w, scaling, TOP_K, K_PAD)


    @triton.jit
    def choose_if_last(logits_ptr, bias_ptr, weights_ptr, ids_ptr, counter_ptr, programs, m, mmask, stride_l, scaling,
                       BLOCK_M: tl.constexpr, E: tl.constexpr, E_PAD: tl.constexpr, N_GROUP: tl.constexpr,
                       TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, NORM: tl.constexpr,
                       SOFTMAX: tl.constexpr, GATHER_W: tl.constexpr):
        """Called by each of `programs` programs once it stored its share of rows m's logits: the last
        to arrive (an acq_rel atomic: the others' stores are visible to it, as in kda_step's split)
        chooses the rows' experts (`choose`), stores them, and zeroes the counter for the next
        launch. The barrier first: the atomic is one thread's, and its release covers the stores of
        the program's other warps only once they are ordered before it."""
        tl.debug_barrier()
        if tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") == programs - 1:
            tl.atomic_xchg(counter_ptr, 0, sem="relaxed", scope="gpu")
            tl.debug_barrier()  # every thread after the acquire
            chosen, w = choose(logits_ptr, bias_ptr, m, mmask, stride_l, BLOCK_M, E, E_PAD, N_GROUP, TOPK_GROUP,
                                    TOP_K, K_PAD, NORM, SOFTMAX, GATHER_W)
            _store(weights_ptr, ids_ptr, m, mmask, chosen, w, scaling, TOP_K, K_PAD)

    @triton.jit
    def _store(weights_ptr, ids_ptr, m, mmask, chosen, w, scaling, TOP_K: tl.constexpr, K_PAD: tl.constexpr):
        """Rows m's experts and scaled weights into row-major [M, TOP_K] outputs."""
        ks = tl.arange(0, K_PAD)
        out = m[:, None] * TOP_K + ks[None, :]
        kmask = mmask[:, None] & (ks < TOP_K)[None, :]
        tl.store(ids_ptr + out, chosen, mask=kmask)
        tl.store(weights_ptr + out, w * scaling, mask=kmask)


def in_entry_takes(rows: int, experts: int, row_block: int) -> bool:
    """The MoE entry kernel's last router program of each row block selects (`choose_if_last`), one
    launch a layer fewer: up to LATENTSERVE_ROUTE_IN_ENTRY rows (0: never; a candidate, bench/gpu.py's
    `route_in_entry` at 1 and `route_in_entry_16` / `_64` up to 16 / 64). From 2 rows only where a
    row block's logits tile is at most 64 x 64 (sm_90, 4 warps: `small`'s 64 experts add no
    registers at 16-row blocks and 6 at 64; Kimi-K3's 896 at 16-row blocks spill ~870 bytes)."""
    if GUARD.failure is not None or rows > int(os.environ.get("LATENTSERVE_ROUTE_IN_ENTRY", "0")):
        return False
    return rows == 1 or triton.next_power_of_2(experts) * row_block <= 64 * 64


GUARD = KernelGuard("route_in_entry")  # a first-call failure: the entry and selection launches apart
_ARRIVALS = ArrivalCounters()


def run_in_entry(op, *args):
    """op(*args), or None when its first call in this process fails (`KernelGuard`)."""
    return GUARD.call(op, *args)


def arrival_counters(device: torch.device, blocks: int) -> torch.Tensor | None:
    """The zeroed counters `choose_if_last` counts on, one a row block (None inside a capture that
    would make them). One set a device: a device's entry kernels run one after another, in the
    engine's one stream."""
    return _ARRIVALS.get(device, blocks)


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
    return {"num_warps": warps, "GATHER_W": gather_w()}


def gather_w() -> bool:
    """`choose`'s GATHER_W (LATENTSERVE_ROUTE_SELECT_GATHER, `launch_options`)."""
    return os.environ.get("LATENTSERVE_ROUTE_SELECT_GATHER", "1") == "1"


def select(logits: torch.Tensor, bias: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, n_group: int,
           topk_group: int, top_k: int, norm_topk_prob: bool, scaling: float, softmax: bool) -> None:
    """Fill weights and ids [M, top_k] from the logits [M, E], one program a token."""
    consts = meta(logits.shape[1], n_group, topk_group, top_k, norm_topk_prob, softmax)
    _route_select_kernel[(logits.shape[0],)](
        logits, bias, weights, ids, logits.stride(0), float(scaling), **consts,
        **launch_options(consts["E_PAD"]), **pdl.launch(logits.device))
