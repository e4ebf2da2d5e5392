"""The MoE layer's three reads of its input, in one kernel, for decode steps of up to `max_rows`
tokens (one row in registers, more on tensor-core tiles).

A latent MoE layer starts with three projections of the same normed hidden row: the router's
logits (fp32), the latent down-projection, and the shared experts' gate/up with their
activation. On the H200 a 3-8 MB projection costs 4-7 us whoever writes it (bench/RESULTS.md,
fourth run): the kernel's fixed cost, not bandwidth. So one launch whose programs split the
three weights' rows between them replaces three launches plus the activation's. Each program
streams BLOCK_N rows of one weight (for the shared experts: BLOCK_N gate rows and the matching up
rows, so the activation is in its epilogue) with fp32 accumulation, and rounds as the separate
ops do: logits in fp32, the latent and the GEMM outputs in the model dtype, then
`layers.act_and_mul`'s roundings. FP8 models take it too: the latent down and shared gate/up are
block-scaled (the router stays in the model dtype), and each of their weight tiles is scaled as
the FP8 GEMV scales it (fp8.row_times / rows_times). Before, an FP8 layer launched all four apart.

A `torch.library` custom op: compiled decoder layers keep it opaque, CUDA graphs capture it.
"""

from __future__ import annotations

import os

import torch

from ..weights import fp8 as fmt
from . import act_kernels, add_norm, fp8, gemv, moe_kernels, moe_select, pdl
from .act_kernels import ACTS
from .counters import ArrivalCounters
from .kernel_guard import KernelGuard

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def max_rows() -> int:
    """Up to this many rows the entry kernel runs (LATENTSERVE_MOE_ENTRY_MAX_ROWS; 1: one row only,
    the default before run 43; 0: never). From 2 rows its tensor-core tiles replace four launches
    (router, latent down, shared gate/up, activation: 4.1 + 4.4 + 4.8 + 1.4 us a layer at batch 8,
    run 39): batch 8 0.94x, batch 64 0.96x of the step with those launches (run 43, 2026-12-04).
    Above 64 rows, row blocks of 64 read each weight tile once a block, where cuBLAS and the tiled
    router ran: batch 256 1.00x in time, 25.8 -> 22.9 kernels a layer (run 45; 64 is the bench's
    `entry_rows_64` baseline)."""
    return int(os.environ.get("LATENTSERVE_MOE_ENTRY_MAX_ROWS", "256"))


def select_enabled() -> bool:
    """LATENTSERVE_MOE_ENTRY_SELECT=1: at one row with the add-norm fold, the entry kernel also
    chooses the token's experts (its last router program to finish, `_select_if_last`), where
    moe_select's kernel was a launch of its own (2.4 us a layer exposed at batch 1, run 117). A
    candidate, off by default (bench/gpu.py's `entry_select`)."""
    return os.environ.get("LATENTSERVE_MOE_ENTRY_SELECT", "0") == "1" and SELECT_GUARD.failure is None


SELECT_GUARD = KernelGuard("moe_entry_select")  # a first-call failure: the fold without the choice then
_COUNTERS = ArrivalCounters()


def run_select(*args) -> tuple | None:
    """latentserve::moe_entry_add_norm_route(*args), or None when its first call in this process fails."""
    return SELECT_GUARD.call(torch.ops.latentserve.moe_entry_add_norm_route, *args)


def select_constants(meta: dict) -> dict:
    """`_entry_kernel`'s constexprs for the choice, from moe_select.meta's (its E is E_SEL here:
    the kernel's E is its runtime expert count) and the selection kernel's weight gather."""
    consts = {"E_SEL" if name == "E" else name: v for name, v in meta.items()}
    return {**consts, "SELECT": True, "GATHER_W": moe_select.launch_options(meta["E_PAD"])["GATHER_W"]}


def counter(device: torch.device) -> torch.Tensor | None:
    """The zeroed arrival counter of `entry_add_norm_route`'s kernels, one a device for every layer
    (each launch leaves it zeroed); None inside a CUDA graph capture that would have to make it."""
    buf = _COUNTERS.get(device, 1)
    return None if buf is None else buf[:1]


def supported(x: torch.Tensor, down: torch.Tensor, shared_gate_up: torch.Tensor, router: torch.Tensor,
              act: str, down_scale: torch.Tensor | None = None, shared_scale: torch.Tensor | None = None) -> bool:
    """1 to `max_rows` rows, the three weights gemv-sized: all in x's dtype, or down and shared
    FP8 with their scales in one block shape and the router in x's dtype; the MoE kernels on
    (LATENTSERVE_MOE_ENTRY=0 keeps the separate launches: the bench's baseline)."""
    if os.environ.get("LATENTSERVE_MOE_ENTRY", "1") == "0" or not moe_kernels.enabled():
        return False
    if x.dim() != 2 or not 0 < x.shape[0] <= max_rows() or act not in ACTS:
        return False
    if down_scale is None and shared_scale is None:
        return all(gemv.supported(x[:1], w) for w in (down, shared_gate_up, router))
    return (down_scale is not None and shared_scale is not None and gemv.supported(x[:1], router)
            and all(fp8.gemm_supported(x, w) and w.shape[1] == x.shape[1] and w.numel() <= gemv.MAX_WEIGHT_ELEMENTS
                    for w in (down, shared_gate_up))
            and fmt.block_of(down, down_scale) == fmt.block_of(shared_gate_up, shared_scale)
            and fmt.block_of(down, down_scale)[1] >= 16)


if triton is not None:

    @triton.jit
    def _x(x_ptr, k, kmask, add_ptr, g_ptr, inv, FOLD: tl.constexpr):
        """x's row at columns k in fp32; FOLD: rms_norm(x + add) there (add_norm.normed)."""
        if FOLD:
            xv = add_norm.normed(x_ptr, add_ptr, g_ptr, k, kmask, inv)
        else:
            xv = tl.load(x_ptr + k, mask=kmask, other=0.0).to(tl.float32)
        return xv

    @triton.jit
    def _x0(x_ptr, k, kmask, K, add_ptr, g_ptr, eps, BLOCK_K: tl.constexpr, FOLD: tl.constexpr):
        """After the PDL wait: x's first tile in fp32 and, with FOLD, rms_norm(x + add)'s with the
        row's inverse RMS (add_norm.first_tile); else 1.0, unused."""
        if FOLD:
            s0, inv = add_norm.first_tile(x_ptr, add_ptr, K, eps, BLOCK_K)
            xv = add_norm.norm_of(s0, tl.load(g_ptr + k, mask=kmask, other=0.0), inv, x_ptr.dtype.element_ty)
        else:
            xv = tl.load(x_ptr + k, mask=kmask, other=0.0).to(tl.float32)
            inv = 1.0
        return xv, inv

    @triton.jit
    def _rows(w_ptr, x_ptr, n, nmask, K, stride_w, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
              add_ptr, g_ptr, eps, FOLD: tl.constexpr):
        """Rows n of w against x (FOLD: `_x`); the first weight tile is loaded before the PDL wait
        (weights only)."""
        k = tl.arange(0, BLOCK_K)
        kmask = k < K
        w0 = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :], mask=nmask[:, None] & kmask[None, :],
                     other=0.0)
        pdl.enter(PDL)
        x0, inv = _x0(x_ptr, k, kmask, K, add_ptr, g_ptr, eps, BLOCK_K, FOLD)
        acc = w0.to(tl.float32) * x0[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            xv = _x(x_ptr, k, kmask, add_ptr, g_ptr, inv, FOLD)
            w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :], mask=nmask[:, None] & kmask[None, :],
                        other=0.0).to(tl.float32)
            acc += w * xv[None, :]
        return tl.sum(acc, 1)

    @triton.jit
    def _scaled(w, s_ptr, n, k0, stride_s, kblocks, nmask, FP8: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                BLOCK_K: tl.constexpr, SUB: tl.constexpr):
        """A weight tile [BLOCK_N, BLOCK_K] at rows n, columns k0.. in fp32: FP8 times its block scales."""
        tile = w.to(tl.float32)
        if FP8:
            tile = tile * gemv.scale_tile(s_ptr, n, k0, stride_s, kblocks, nmask, BN, BK, BLOCK_K, SUB)
        return tile

    @triton.jit
    def _entry_kernel(x_ptr, down_ptr, shared_ptr, router_ptr, latent_ptr, h_ptr, logits_ptr, down_s_ptr, shared_s_ptr,
                      K, L, INTER, E, stride_d, stride_s, stride_r, stride_ds, stride_ss, beta, linear_beta,
                      add_ptr, g_ptr, sum_ptr, eps, bias_ptr, wts_ptr, ids_ptr, count_ptr, scaling,
                      ACT: tl.constexpr, CLIP_UP: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr, PDL: tl.constexpr, FP8: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                      SUB: tl.constexpr, FOLD: tl.constexpr = False, SELECT: tl.constexpr = False,
                      E_SEL: tl.constexpr = 1, E_PAD: tl.constexpr = 1, N_GROUP: tl.constexpr = 1,
                      TOPK_GROUP: tl.constexpr = 1, TOP_K: tl.constexpr = 1, K_PAD: tl.constexpr = 1,
                      NORM: tl.constexpr = False, SOFTMAX: tl.constexpr = False, GATHER_W: tl.constexpr = False):
        # Each branch waits for the previous kernel (pdl.enter) after its first weight tile. FP8:
        # down and shared are block-scaled (BN x BK blocks, SUB-wide scale runs a K step). FOLD:
        # the input is rms_norm(x + add, g) (add_norm.py), and program 0 writes x + add to sum.
        # SELECT: the router's programs come first, and the last of them to store its logits
        # chooses the token's experts (`_select_if_last`).
        pid = tl.program_id(0)
        kblocks = tl.cdiv(K, BK)
        p_down = tl.cdiv(L, BLOCK_N)
        p_shared = tl.cdiv(INTER, BLOCK_N)
        if SELECT:
            p_router = tl.cdiv(E, BLOCK_N)
            pid = tl.where(pid < p_router, pid + p_down + p_shared, pid - p_router)
        dtype = latent_ptr.dtype.element_ty
        if pid < p_down:
            n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
            if FP8:
                y = fp8.row_times(x_ptr, down_ptr, down_s_ptr, n, n < L, K, stride_d, stride_ds, BN, BK, BLOCK_K, SUB,
                                  PDL)
            else:
                y = _rows(down_ptr, x_ptr, n, n < L, K, stride_d, BLOCK_N, BLOCK_K, PDL, add_ptr, g_ptr, eps, FOLD)
            tl.store(latent_ptr + n, y.to(dtype), mask=n < L)
            if FOLD and pid == 0:
                add_norm.store_sum(x_ptr, add_ptr, sum_ptr, K, BLOCK_K)
        elif pid < p_down + p_shared:
            n = (pid - p_down) * BLOCK_N + tl.arange(0, BLOCK_N)
            nmask = n < INTER
            # Gate and up rows in the same K loop: twice the loads in flight, not two serial passes
            # (the fifth H200 run: 15.9 us for the kernel with two passes).
            rows = shared_ptr + n[:, None].to(tl.int64) * stride_s
            k = tl.arange(0, BLOCK_K)
            kmask = k < K
            wmask = nmask[:, None] & kmask[None, :]
            g0 = _scaled(tl.load(rows + k[None, :], mask=wmask, other=0.0), shared_s_ptr, n, 0, stride_ss, kblocks,
                         nmask, FP8, BN, BK, BLOCK_K, SUB)
            u0 = _scaled(tl.load(rows + INTER * stride_s + k[None, :], mask=wmask, other=0.0), shared_s_ptr, INTER + n, 0,
                         stride_ss, kblocks, nmask, FP8, BN, BK, BLOCK_K, SUB)
            pdl.enter(PDL)
            x0, inv = _x0(x_ptr, k, kmask, K, add_ptr, g_ptr, eps, BLOCK_K, FOLD)
            acc_g = g0 * x0[None, :]
            acc_u = u0 * x0[None, :]
            for k0 in range(BLOCK_K, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                kmask = k < K
                wmask = nmask[:, None] & kmask[None, :]
                xv = _x(x_ptr, k, kmask, add_ptr, g_ptr, inv, FOLD)
                acc_g += _scaled(tl.load(rows + k[None, :], mask=wmask, other=0.0), shared_s_ptr, n, k0, stride_ss,
                                 kblocks, nmask, FP8, BN, BK, BLOCK_K, SUB) * xv[None, :]
                acc_u += _scaled(tl.load(rows + INTER * stride_s + k[None, :], mask=wmask, other=0.0), shared_s_ptr,
                                 INTER + n, k0, stride_ss, kblocks, nmask, FP8, BN, BK, BLOCK_K, SUB) * xv[None, :]
            h = act_kernels.gated(tl.sum(acc_g, 1), tl.sum(acc_u, 1), beta, linear_beta, dtype, ACT, CLIP_UP)
            tl.store(h_ptr + n, h.to(dtype), mask=nmask)
        else:
            n = (pid - p_down - p_shared) * BLOCK_N + tl.arange(0, BLOCK_N)
            tl.store(logits_ptr + n, _rows(router_ptr, x_ptr, n, n < E, K, stride_r, BLOCK_N, BLOCK_K, PDL, add_ptr, g_ptr,
                                                  eps, FOLD), mask=n < E)
            if SELECT:
                _select_if_last(logits_ptr, bias_ptr, wts_ptr, ids_ptr, count_ptr, scaling, tl.cdiv(E, BLOCK_N), E_SEL,
                                E_PAD, N_GROUP, TOPK_GROUP, TOP_K, K_PAD, NORM, SOFTMAX, GATHER_W)

    @triton.jit
    def _select_if_last(logits_ptr, bias_ptr, wts_ptr, ids_ptr, count_ptr, scaling, programs, E: tl.constexpr,
                        E_PAD: tl.constexpr, N_GROUP: tl.constexpr, TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr,
                        K_PAD: tl.constexpr, NORM: tl.constexpr, SOFTMAX: tl.constexpr, GATHER_W: tl.constexpr):
        """Each router program counts itself in after its logits (a CTA barrier, then an acq_rel
        atomic: the counter pattern of kda_step and bench/persistent_probe.py); the last to arrive
        reads all of them and stores the experts and weights moe_select's kernel would, then zeroes
        the counter for the next layer. Nobody waits: the others leave. The router's programs run
        first, so the choice overlaps the latent and shared programs still streaming weights."""
        tl.debug_barrier()  # this program's logits, stored by all its threads
        if tl.atomic_add(count_ptr, 1, sem="acq_rel", scope="gpu") == programs - 1:
            tl.atomic_xchg(count_ptr, 0, sem="relaxed", scope="gpu")
            tl.debug_barrier()  # every thread after the acquire
            chosen, w = moe_select.choose(logits_ptr, bias_ptr, 0, 0, E, E_PAD, N_GROUP, TOPK_GROUP, TOP_K, K_PAD, NORM,
                                          SOFTMAX, GATHER_W)
            ks = tl.arange(0, K_PAD)
            tl.store(ids_ptr + ks, chosen, mask=ks < TOP_K)
            tl.store(wts_ptr + ks, w * scaling, mask=ks < TOP_K)

    @triton.jit
    def _tile(w, s_ptr, n, k0, stride_s, kblocks, nmask, dtype: tl.constexpr, FP8: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr):
        """A weight tile for the tensor cores: FP8 scaled in fp32 and rounded to the activations' dtype."""
        if FP8:  # one return: the compiler types every return statement, the interpreter does not
            tile = (w.to(tl.float32) * gemv.scale_tile(s_ptr, n, k0, stride_s, kblocks, nmask, BN, BK, BLOCK_K,
                                                       SUB)).to(dtype)
        else:
            tile = w
        return tile

    @triton.jit(do_not_specialize=["M"])
    def _entry_rows_kernel(x_ptr, down_ptr, shared_ptr, router_ptr, latent_ptr, h_ptr, logits_ptr, down_s_ptr,
                           shared_s_ptr, M, K, L, INTER, E, stride_x, stride_d, stride_s, stride_r, stride_ds, stride_ss,
                           beta, linear_beta, ACT: tl.constexpr, CLIP_UP: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr,
                           FP8: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, SUB: tl.constexpr):
        """`_entry_kernel` from 2 rows: programs split the three weights' rows between them and
        multiply a block of rows (padded to a 16 or 64-row tile) on tensor cores, as gemv.py's
        tiles do; the shared experts' gate and up tiles share one pass, the activation in the
        epilogue. Row blocks are the grid's first axis, so the blocks reading one weight tile
        run side by side and all but the first find it in L2. Outputs are row-major [M, L],
        [M, INTER], [M, E]. FP8: each weight tile scaled in fp32 and rounded to x's dtype for the
        dot, as the FP8 GEMV's tiles (fp8.rows_times)."""
        pid = tl.program_id(1)
        p_down = tl.cdiv(L, BLOCK_N)
        p_shared = tl.cdiv(INTER, BLOCK_N)
        dtype = latent_ptr.dtype.element_ty
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = m < M
        if pid < p_down:
            n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
            if FP8:
                acc = fp8.rows_times(x_ptr, down_ptr, down_s_ptr, m, n, mmask, n < L, K, stride_x, stride_d, stride_ds,
                                     BN, BK, BLOCK_M, BLOCK_N, BLOCK_K, SUB, PDL)
            else:
                acc = gemv._rows_times(x_ptr, down_ptr, m, n, mmask, n < L, K, stride_x, stride_d, BLOCK_M, BLOCK_N,
                                       BLOCK_K, True, IEEE, PDL)
            tl.store(latent_ptr + m[:, None] * L + n[None, :], acc.to(dtype), mask=mmask[:, None] & (n < L)[None, :])
        elif pid < p_down + p_shared:
            n = (pid - p_down) * BLOCK_N + tl.arange(0, BLOCK_N)
            nmask = n < INTER
            rows = shared_ptr + n[:, None].to(tl.int64) * stride_s
            k = tl.arange(0, BLOCK_K)
            wmask = nmask[:, None] & (k < K)[None, :]
            kblocks = tl.cdiv(K, BK)
            g = _tile(tl.load(rows + k[None, :], mask=wmask, other=0.0), shared_s_ptr, n, 0, stride_ss, kblocks, nmask,
                      dtype, FP8, BN, BK, BLOCK_K, SUB)
            u = _tile(tl.load(rows + INTER * stride_s + k[None, :], mask=wmask, other=0.0), shared_s_ptr, INTER + n, 0,
                      stride_ss, kblocks, nmask, dtype, FP8, BN, BK, BLOCK_K, SUB)
            pdl.enter(PDL)
            xv = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=mmask[:, None] & (k < K)[None, :], other=0.0)
            acc_g = gemv._product(tl.zeros([BLOCK_M, BLOCK_N], tl.float32), xv, g, True, IEEE)
            acc_u = gemv._product(tl.zeros([BLOCK_M, BLOCK_N], tl.float32), xv, u, True, IEEE)
            for k0 in range(BLOCK_K, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                kmask = k < K
                wmask = nmask[:, None] & kmask[None, :]
                xv = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=mmask[:, None] & kmask[None, :], other=0.0)
                g = _tile(tl.load(rows + k[None, :], mask=wmask, other=0.0), shared_s_ptr, n, k0, stride_ss, kblocks,
                          nmask, dtype, FP8, BN, BK, BLOCK_K, SUB)
                u = _tile(tl.load(rows + INTER * stride_s + k[None, :], mask=wmask, other=0.0), shared_s_ptr, INTER + n,
                          k0, stride_ss, kblocks, nmask, dtype, FP8, BN, BK, BLOCK_K, SUB)
                acc_g = gemv._product(acc_g, xv, g, True, IEEE)
                acc_u = gemv._product(acc_u, xv, u, True, IEEE)
            h = act_kernels.gated(acc_g, acc_u, beta, linear_beta, dtype, ACT, CLIP_UP)
            tl.store(h_ptr + m[:, None] * INTER + n[None, :], h.to(dtype), mask=mmask[:, None] & nmask[None, :])
        else:
            n = (pid - p_down - p_shared) * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = gemv._rows_times(x_ptr, router_ptr, m, n, mmask, n < E, K, stride_x, stride_r, BLOCK_M, BLOCK_N,
                                   BLOCK_K, True, IEEE, PDL)
            tl.store(logits_ptr + m[:, None] * E + n[None, :], acc, mask=mmask[:, None] & (n < E)[None, :])

    def _rows_launch(bm: int, k: int, weight_bytes: int) -> dict:
        """The multi-row launch for row tiles of bm. At 16-row tiles (2-16 rows) of 16-bit weights, 32
        outputs a program at 4 stages (run 62, H100, 8 rows: 7.31 us against 16 at 3 stages' 7.98 in
        the same sweep; gate + up + x 40 KB a stage); the default since runs 105-106 with the other
        switches of bench/gpu.py's `small_stack_off`; LATENTSERVE_MOE_ENTRY_WIDE_N=0: 16 at 3
        (`entry_narrow_n`).
        Not for FP8, whose weight tiles become fp32 registers, nor fp32, whose 80 KB stages overflow
        shared memory at 4 (run 73, H100: 240 KB asked, 227 KB there)."""
        launch = {"BLOCK_N": 16, "num_warps": 4, "num_stages": 3,
                  # gate + up + x: <= 48 KB a stage
                  "BLOCK_K": max(16, min(256 if bm == 16 else 128, triton.next_power_of_2(k)))}
        if bm == 16 and weight_bytes == 2 and os.environ.get("LATENTSERVE_MOE_ENTRY_WIDE_N", "1") == "1":
            launch.update(BLOCK_N=32, num_stages=4)
        # Tried and removed (run 78, H100): above 64 rows, 32-64-output blocks: batch 256 0.99x.
        return launch

    def _entry(x, down, shared_gate_up, router, act, beta, linear_beta, down_scale=None, shared_scale=None,
               cfg=None, fold=None, route=None):
        """cfg overrides the multi-row launch (BLOCK_N, BLOCK_K, num_warps, num_stages): bench/moe_entry.py's
        sweep. fold: (add, norm weight, eps, out), 16/32-bit weights: the input is rms_norm(x + add),
        and x + add goes to out (`entry_add_norm`). route: (bias, weights out, ids out, counter,
        scaling, `select_constants`), one row: the experts chosen in the kernel too."""
        m, k = x.shape
        latent_dim, inter, experts = down.shape[0], shared_gate_up.shape[0] // 2, router.shape[0]
        latent = torch.empty(m, latent_dim, dtype=x.dtype, device=x.device)
        h = torch.empty(m, inter, dtype=x.dtype, device=x.device)
        logits = torch.empty(m, experts, dtype=torch.float32, device=x.device)
        x = x if x.stride(-1) == 1 else x.contiguous()
        is_fp8 = down_scale is not None
        bn_s, bk_s = fmt.block_of(down, down_scale) if is_fp8 else (16, 16)
        scales = (down_scale, shared_scale) if is_fp8 else (down, shared_gate_up)  # unread without FP8
        strides = (down_scale.stride(0), shared_scale.stride(0)) if is_fp8 else (0, 0)
        if fold is not None and (is_fp8 or m > 1):
            raise ValueError("the add-norm fold takes one row of 16/32-bit weights")
        if route is not None and m > 1:
            raise ValueError("the entry kernel chooses experts for one row")
        bias, wts, ids, counter, scaling, consts = route if route is not None else (x, x, x, x, 1.0, {})
        add, g, eps, total = fold if fold is not None else (x, x, 0.0, x)  # unread without FOLD
        if m > 1:
            bm = gemv.rows_tile(m, True)
            launch = {**_rows_launch(bm, k, down.element_size()), **(cfg or {})}
            bn, bk = launch["BLOCK_N"], launch["BLOCK_K"]
            grid = triton.cdiv(latent_dim, bn) + triton.cdiv(inter, bn) + triton.cdiv(experts, bn)
            _entry_rows_kernel[(triton.cdiv(m, bm), grid)](
                x, down, shared_gate_up, router, latent, h, logits, *scales, m, k, latent_dim, inter, experts,
                x.stride(0), down.stride(0), shared_gate_up.stride(0), router.stride(0), *strides, float(beta),
                float(linear_beta or 1.0), ACT=ACTS[act], CLIP_UP=linear_beta is not None, BLOCK_M=bm,
                IEEE=x.dtype == torch.float32, FP8=is_fp8, BN=bn_s, BK=bk_s, SUB=min(bk_s, bk), **launch,
                **pdl.launch(x.device))
            return latent, h, logits
        # As the one-row GEMV since run 39, each program's whole K slice (up to 2048) in one step,
        # all of it requested before the PDL wait (sm_90: 170 registers, no spills): batch 1 0.99x
        # of 8-row programs in 512-wide steps (run 43). LATENTSERVE_MOE_ENTRY_WHOLE_K=0 keeps those.
        # FP8 takes the FP8 GEMV's 1024 (its fp32 scale tiles are registers too).
        bn, bk = 4, min(1024 if is_fp8 else 2048, triton.next_power_of_2(k))
        if os.environ.get("LATENTSERVE_MOE_ENTRY_WHOLE_K", "1") == "0":
            bn, bk = 8, min(512, triton.next_power_of_2(k))
        grid = triton.cdiv(latent_dim, bn) + triton.cdiv(inter, bn) + triton.cdiv(experts, bn)
        _entry_kernel[(grid,)](x, down, shared_gate_up, router, latent, h, logits, *scales, k, latent_dim, inter,
                               experts, down.stride(0), shared_gate_up.stride(0), router.stride(0), *strides,
                               float(beta), float(linear_beta or 1.0), add, g, total, float(eps), bias, wts, ids,
                               counter, float(scaling), ACT=ACTS[act], CLIP_UP=linear_beta is not None, BLOCK_N=bn,
                               BLOCK_K=bk, FP8=is_fp8, BN=bn_s, BK=bk_s, SUB=min(bk_s, bk), FOLD=fold is not None,
                               num_warps=4, num_stages=4, **consts, **pdl.launch(x.device))
        return latent, h, logits

    @torch.library.custom_op("latentserve::moe_entry", mutates_args=())
    def entry(x: torch.Tensor, down: torch.Tensor, shared_gate_up: torch.Tensor, router: torch.Tensor, act: str,
              beta: float, linear_beta: float | None, down_scale: torch.Tensor | None = None,
              shared_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [M, H] -> (x @ down^T [M, L], act(x @ gate^T) * (x @ up^T) [M, I], fp32 x @ router^T [M, E]);
        with scales, down and shared_gate_up are FP8 block-scaled (`supported`)."""
        return _entry(x, down, shared_gate_up, router, act, beta, linear_beta, down_scale, shared_scale)

    @entry.register_fake
    def _(x, down, shared_gate_up, router, act, beta, linear_beta, down_scale=None, shared_scale=None):
        m = x.shape[0]
        return (x.new_empty(m, down.shape[0]), x.new_empty(m, shared_gate_up.shape[0] // 2),
                x.new_empty(m, router.shape[0], dtype=torch.float32))

    @torch.library.custom_op("latentserve::moe_entry_add_norm", mutates_args=())
    def entry_add_norm(x: torch.Tensor, add: torch.Tensor, norm_weight: torch.Tensor, eps: float, down: torch.Tensor,
                       shared_gate_up: torch.Tensor, router: torch.Tensor, act: str, beta: float,
                       linear_beta: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """`entry` of rms_norm(x + add, norm_weight, eps), and x + add: a decoder layer's
        post-attention add and norm inside the entry kernel (add_norm.py)."""
        total = torch.empty_like(x)
        return *_entry(x, down, shared_gate_up, router, act, beta, linear_beta,
                       fold=(add, norm_weight, eps, total)), total

    @entry_add_norm.register_fake
    def _(x, add, norm_weight, eps, down, shared_gate_up, router, act, beta, linear_beta):
        m = x.shape[0]
        return (x.new_empty(m, down.shape[0]), x.new_empty(m, shared_gate_up.shape[0] // 2),
                x.new_empty(m, router.shape[0], dtype=torch.float32), torch.empty_like(x))

    @torch.library.custom_op("latentserve::moe_entry_add_norm_route", mutates_args=())
    def entry_add_norm_route(x: torch.Tensor, add: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                             down: torch.Tensor, shared_gate_up: torch.Tensor, router: torch.Tensor, act: str,
                             beta: float, linear_beta: float | None, bias: torch.Tensor, n_group: int,
                             topk_group: int, top_k: int, norm_topk_prob: bool, scaling: float,
                             softmax: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                                     torch.Tensor, torch.Tensor]:
        """`entry_add_norm`, then the token's routing weights [1, top_k] fp32 and expert ids [1, top_k]
        as latentserve::moe_route_select gives them for its logits, chosen inside the same kernel
        (`select_enabled`); by the selection kernel after it inside a CUDA graph capture that would
        have to make the arrival counter (`counter`: here, not in the caller, which compiled layers
        trace)."""
        total = torch.empty_like(x)
        wts = torch.empty(1, top_k, dtype=torch.float32, device=x.device)
        ids = torch.empty(1, top_k, dtype=torch.long, device=x.device)
        arrivals = counter(x.device)
        fold = (add, norm_weight, eps, total)
        if arrivals is None:
            latent, h, logits = _entry(x, down, shared_gate_up, router, act, beta, linear_beta, fold=fold)
            moe_select.select(logits, bias, wts, ids, n_group, topk_group, top_k, norm_topk_prob, scaling, softmax)
            return latent, h, logits, total, wts, ids
        consts = select_constants(moe_select.meta(router.shape[0], n_group, topk_group, top_k, norm_topk_prob, softmax))
        latent, h, logits = _entry(x, down, shared_gate_up, router, act, beta, linear_beta, fold=fold,
                                   route=(bias, wts, ids, arrivals, scaling, consts))
        return latent, h, logits, total, wts, ids

    @entry_add_norm_route.register_fake
    def _(x, add, norm_weight, eps, down, shared_gate_up, router, act, beta, linear_beta, bias, n_group, topk_group,
          top_k, norm_topk_prob, scaling, softmax):
        m = x.shape[0]
        return (x.new_empty(m, down.shape[0]), x.new_empty(m, shared_gate_up.shape[0] // 2),
                x.new_empty(m, router.shape[0], dtype=torch.float32), torch.empty_like(x),
                x.new_empty(m, top_k, dtype=torch.float32), x.new_empty(m, top_k, dtype=torch.long))
