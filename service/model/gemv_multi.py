"""Projections of the same rows as one GEMV launch: y = x @ [W_0; W_1; ...]^T, each weight where
it is, no concatenated copy of them.

A KDA layer reads its input through six projections (q, k, v, the output gate or its low-rank
half, the forget gate's low-rank half, beta): six launches and a cat of q|k|v in a decode step, each
launch a few microseconds of fixed cost for ~2 MB of weights (bench/notes/batch1-launch-floor.md).
Their weights are separate parameters with their own TP sharding (q/k/v/g by head, f_a
replicated), so one fused parameter cannot hold them; one launch can: its programs are split
among the weights by output block, each running gemv.py's tile (`_rows_times`: the first weight
tile requested before the PDL wait) on its own weight and writing its own columns of y.
`torch.library` custom op; `supported` decides; callers split y into views.
"""

from __future__ import annotations

import os

import torch

from . import gemv, pdl
from .kernel_guard import KernelGuard

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

MAX_SEGMENTS = 6
GUARD = KernelGuard("gemv_multi")


def enabled() -> bool:
    """On by default (LATENTSERVE_GEMV_MULTI=0: a launch per projection). Run 61 (H100), with the
    KDA step kernel: K3's decode step 0.93x / 0.94x / 0.97x of the step kernel alone at 1 / 8 / 64."""
    return os.environ.get("LATENTSERVE_GEMV_MULTI", "1") == "1"


def supported(x: torch.Tensor, weights: list[torch.Tensor]) -> bool:
    return (enabled() and GUARD.failure is None and 1 < len(weights) <= MAX_SEGMENTS
            and all(gemv.supported(x, w) and w.is_contiguous() for w in weights))


def run(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor | None:
    """x @ cat(weights)^T, or None when the op's first call in this process fails (then the
    caller's separate projections run)."""
    return GUARD.call(torch.ops.latentserve.gemv_multi, x, weights)


if triton is not None:

    @triton.jit
    def _past(local, col, w_ptr, width, w_next, n_next, BLOCK_N: tl.constexpr):
        """A block index past this segment's cdiv(width, BLOCK_N) blocks moves to the next one."""
        blocks = tl.cdiv(width, BLOCK_N)
        if local >= blocks:
            local, col, w_ptr, width = local - blocks, col + width, w_next, n_next
        return local, col, w_ptr, width

    @triton.jit(do_not_specialize=["M"])
    def _multi_kernel(x_ptr, y_ptr, M, K, stride_x, stride_y, w0, w1, w2, w3, w4, w5, n0, n1, n2, n3, n4, n5,
                      SEGMENTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      DOT: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
        """Program (output block, row block): its weight is the one whose blocks its index falls in
        (segments of cdiv(n_s, BLOCK_N) blocks, in order), its columns that weight's from col."""
        local = tl.program_id(0)
        w_ptr, width, col = w0, n0, 0
        if SEGMENTS > 1:
            local, col, w_ptr, width = _past(local, col, w_ptr, width, w1, n1, BLOCK_N)
        if SEGMENTS > 2:
            local, col, w_ptr, width = _past(local, col, w_ptr, width, w2, n2, BLOCK_N)
        if SEGMENTS > 3:
            local, col, w_ptr, width = _past(local, col, w_ptr, width, w3, n3, BLOCK_N)
        if SEGMENTS > 4:
            local, col, w_ptr, width = _past(local, col, w_ptr, width, w4, n4, BLOCK_N)
        if SEGMENTS > 5:
            local, col, w_ptr, width = _past(local, col, w_ptr, width, w5, n5, BLOCK_N)
        n = local * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        nmask, mmask = n < width, m < M
        acc = gemv._rows_times(x_ptr, w_ptr, m, n, mmask, nmask, K, stride_x, K, BLOCK_M, BLOCK_N, BLOCK_K, DOT,
                               IEEE, PDL)
        tl.store(y_ptr + m[:, None] * stride_y + col + n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])

    def _multi(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        k = x.shape[-1]
        x2 = gemv.rows(x)
        m, widths = x2.shape[0], [w.shape[0] for w in weights]
        y = torch.empty(m, sum(widths), dtype=x.dtype, device=x.device)
        # The widest weight's own launch shape (one row: whole-K slices of a few rows a program),
        # so each segment runs the tiles its separate launch would.
        cfg = {"DOT": False, **gemv.shape(m, max(widths), k, gemv.sm_count(x.device), x.element_size())}
        block_m = gemv.rows_tile(m, cfg["DOT"])
        pad = MAX_SEGMENTS - len(weights)
        blocks = sum(triton.cdiv(n, cfg["BLOCK_N"]) for n in widths)
        _multi_kernel[(blocks, triton.cdiv(m, block_m))](
            x2, y, m, k, x2.stride(0), y.stride(0), *weights, *[weights[0]] * pad, *widths, *[0] * pad,
            SEGMENTS=len(weights), BLOCK_M=block_m, IEEE=x.dtype == torch.float32, **cfg, **pdl.launch(x.device))
        return y.view(*x.shape[:-1], sum(widths))

    @torch.library.custom_op("latentserve::gemv_multi", mutates_args=())
    def gemv_multi(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
        """x [..., K] @ each weight [N_s, K]^T, side by side -> [..., sum N_s] in x's dtype."""
        return _multi(x, weights)

    @gemv_multi.register_fake
    def _(x, weights):
        return x.new_empty(*x.shape[:-1], sum(w.shape[0] for w in weights))
