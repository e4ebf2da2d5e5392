"""A residual add and the RMS norm after it, folded into the projection that reads the normed rows:
fused_qkv_a's GEMV for the input norm, the MoE entry kernel for the post-attention norm
(LATENTSERVE_FOLD_ADD_NORM=1, a candidate until bench/gpu.py's `fold_add_norm` times it).

At batches 1-8 each of a decoder layer's two add + norm kernels (Inductor's) costs ~1.8 us
without PDL for a few KB of reads (run 45): fixed latency, not bytes. Every program of the
projection after it reads the whole normed rows from L2 anyway, so it can as well read the stream
and the pending sublayer output, add, norm and multiply; one program writes the sum back as the
new stream. At one row a program first sums the row's squares (its first tile stays in
registers), with the unfused ops' roundings: the add rounded to the model dtype, then
rms_norm_hf's two. From 2 rows such a pass ahead of the tensor-core pipeline is what made the
latent MoE's norm inside its paired GEMV lose (1.02x at 8 rows, run 46), so there the norm is
factored out: (x + add) * g is multiplied and each row scaled by its inverse RMS at the end.
Up to 16 rows (`max_rows`), one row tile.

Not for FP8 weights, Kimi-K3's attention residuals, KDA layers or MLA with an output gate (their
inputs go through other kernels); those keep the compiled add + norm.
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

# K step from 2 rows: the add, the squares and the weight's product sit in registers beside the
# tile. Compiled for sm_90 at 16 rows in 256-wide steps the GEMV held 255 registers and spilled 20
# bytes, the entry kernel 216; in 128-wide ones 128 and 168, no spill.
ROWS_MAX_K = 128
GUARD = KernelGuard("add_norm")  # a first-call failure turns the fold off: the compiled add + norm then


def max_rows() -> int:
    """Up to this many rows the fold runs (LATENTSERVE_FOLD_ADD_NORM_MAX_ROWS, 1). Run 105 (H100):
    at 8 rows the tensor-core kernels took 28 us where the plain GEMV took 4.0 and the entry 6.3
    (the step 1.37x), the one-row ones 2.5 / 4.9 against 2.3 / 3.9 (the step 0.95x at batch 1).
    16 (one row tile) is the rows variant's bench baseline until that is understood."""
    return int(os.environ.get("LATENTSERVE_FOLD_ADD_NORM_MAX_ROWS", "1"))


def enabled(x: torch.Tensor, add: torch.Tensor | None) -> bool:
    """The switch on, and x, add contiguous [M, K] of one dtype on a kernel device, M <= max_rows()."""
    return (os.environ.get("LATENTSERVE_FOLD_ADD_NORM", "0") == "1" and triton is not None and GUARD.failure is None
            and add is not None and (x.is_cuda or gemv.INTERPRET) and x.dim() == 2 and 0 < x.shape[0] <= max_rows()
            and add.shape == x.shape and add.dtype == x.dtype and x.is_contiguous() and add.is_contiguous())


def gemv_supported(x: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor) -> bool:
    return enabled(x, add) and gemv.supported(x, weight)


def run(op, *args):
    """op(*args), or None when its first call in this process fails (`KernelGuard`)."""
    return GUARD.call(op, *args)


if triton is not None:

    @triton.jit
    def row_sum(x_ptr, add_ptr, k, kmask):
        """x + add at columns k, rounded to x's dtype as the add alone rounds, in fp32."""
        x = tl.load(x_ptr + k, mask=kmask, other=0.0)
        a = tl.load(add_ptr + k, mask=kmask, other=0.0)
        return (x.to(tl.float32) + a.to(tl.float32)).to(x.dtype).to(tl.float32)

    @triton.jit
    def first_tile(x_ptr, add_ptr, K, eps, BLOCK_K: tl.constexpr):
        """(x + add at columns 0..BLOCK_K in fp32, the row's 1 / sqrt(mean((x + add)^2) + eps)): one
        pass over the row from L2 whose first tile stays in registers (at K <= BLOCK_K, as for a
        2048-wide row at one row's launch, the only one)."""
        k = tl.arange(0, BLOCK_K)
        s0 = row_sum(x_ptr, add_ptr, k, k < K)
        ss = s0 * s0
        for k0 in range(BLOCK_K, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            s = row_sum(x_ptr, add_ptr, k, k < K)
            ss += s * s
        return s0, tl.rsqrt(tl.sum(ss, 0) / K + eps)

    @triton.jit
    def norm_of(s, g, inv, dtype: tl.constexpr):
        """rms_norm_hf's output from the sum s (fp32) and the weight g, with its two roundings to
        dtype, in fp32."""
        return (g.to(tl.float32) * (s * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)

    @triton.jit
    def normed(x_ptr, add_ptr, g_ptr, k, kmask, inv):
        """rms_norm_hf(x + add) at columns k (a tile after the first), in fp32."""
        g = tl.load(g_ptr + k, mask=kmask, other=0.0)
        return norm_of(row_sum(x_ptr, add_ptr, k, kmask), g, inv, x_ptr.dtype.element_ty)

    @triton.jit
    def store_sum(x_ptr, add_ptr, out_ptr, K, BLOCK_K: tl.constexpr):
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            tl.store(out_ptr + k, row_sum(x_ptr, add_ptr, k, k < K).to(out_ptr.dtype.element_ty), mask=k < K)

    @triton.jit
    def rows_tile(x_ptr, add_ptr, g_ptr, sum_ptr, m, k, mmask, kmask, K, write):
        """From 2 rows: (x + add) at rows m, columns k (rounded as the add rounds) times g, rounded to
        x's dtype for the tensor cores, and each row's sum of squares there; with `write` the sums
        are stored too (one program of a row block writes). x, add contiguous [M, K]."""
        mask = mmask[:, None] & kmask[None, :]
        off = m[:, None] * K + k[None, :]
        x = tl.load(x_ptr + off, mask=mask, other=0.0)
        s = (x.to(tl.float32) + tl.load(add_ptr + off, mask=mask, other=0.0).to(tl.float32)).to(x.dtype)
        tl.store(sum_ptr + off, s, mask=mask & write)
        sf = s.to(tl.float32)
        g = tl.load(g_ptr + k, mask=kmask, other=0.0).to(tl.float32)
        return (sf * g[None, :]).to(x.dtype), tl.sum(sf * sf, 1)

    @triton.jit
    def rows_times(x_ptr, add_ptr, g_ptr, sum_ptr, w_ptr, m, n, mmask, nmask, K, stride_w, eps, write,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                   PDL: tl.constexpr):
        """rms_norm(x + add)[m] @ w[n]^T in fp32 from 2 rows, on tensor cores, with the norm factored
        out of the product: (x + add) * g is multiplied and each row scaled by its inverse RMS after
        the K loop, so no pass over the rows precedes the first product (the pair norm's pass cost
        1.02x at 8 rows, run 46). One rounding of the normed row fewer than rms_norm_hf's (the
        product's operand is (x + add) * g rounded, not its normed value), an ulp's difference."""
        k = tl.arange(0, BLOCK_K)
        w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :], mask=nmask[:, None] & (k < K)[None, :],
                    other=0.0)
        pdl.enter(PDL)
        xg, ss = rows_tile(x_ptr, add_ptr, g_ptr, sum_ptr, m, k, mmask, k < K, K, write)
        acc = gemv._product(tl.zeros([BLOCK_M, BLOCK_N], tl.float32), xg, w, True, IEEE)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(w_ptr + n[:, None].to(tl.int64) * stride_w + k[None, :],
                        mask=nmask[:, None] & (k < K)[None, :], other=0.0)
            xg, part = rows_tile(x_ptr, add_ptr, g_ptr, sum_ptr, m, k, mmask, k < K, K, write)
            ss += part
            acc = gemv._product(acc, xg, w, True, IEEE)
        return acc * tl.rsqrt(ss / K + eps)[:, None]

    @triton.jit(do_not_specialize=["M"])
    def _add_norm_rows_kernel(x_ptr, add_ptr, g_ptr, w_ptr, y_ptr, sum_ptr, M, N, K, stride_w, eps,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                              PDL: tl.constexpr):
        """`_add_norm_gemv_kernel` from 2 rows (`rows_times`), on gemv.dot_config's tiles."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask, nmask = m < M, n < N
        acc = rows_times(x_ptr, add_ptr, g_ptr, sum_ptr, w_ptr, m, n, mmask, nmask, K, stride_w, eps,
                         tl.program_id(0) == 0, BLOCK_M, BLOCK_N, BLOCK_K, IEEE, PDL)
        tl.store(y_ptr + m[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=mmask[:, None] & nmask[None, :])

    @triton.jit
    def _add_norm_gemv_kernel(x_ptr, add_ptr, g_ptr, w_ptr, y_ptr, sum_ptr, N, K, stride_w, eps,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """y = rms_norm(x + add) @ w^T for one row, as gemv's register product; program 0 also
        writes x + add. The first weight tile is requested before the PDL wait."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = n < N
        rows = w_ptr + n[:, None].to(tl.int64) * stride_w
        k = tl.arange(0, BLOCK_K)
        w = tl.load(rows + k[None, :], mask=nmask[:, None] & (k < K)[None, :], other=0.0)
        pdl.enter(PDL)
        s0, inv = first_tile(x_ptr, add_ptr, K, eps, BLOCK_K)
        x0 = norm_of(s0, tl.load(g_ptr + k, mask=k < K, other=0.0), inv, x_ptr.dtype.element_ty)
        acc = tl.sum(w.to(tl.float32) * x0[None, :], 1)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            w = tl.load(rows + k[None, :], mask=nmask[:, None] & (k < K)[None, :], other=0.0)
            acc += tl.sum(w.to(tl.float32) * normed(x_ptr, add_ptr, g_ptr, k, k < K, inv)[None, :], 1)
        tl.store(y_ptr + n, acc.to(y_ptr.dtype.element_ty), mask=nmask)
        if tl.program_id(0) == 0:
            store_sum(x_ptr, add_ptr, sum_ptr, K, BLOCK_K)

    @torch.library.custom_op("latentserve::gemv_add_norm", mutates_args=())
    def gemv_add_norm(x: torch.Tensor, add: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x, add [M, K] -> (rms_norm(x + add, norm_weight, eps) @ weight^T [M, N], x + add [M, K])."""
        (m, k), n = x.shape, weight.shape[0]
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        total = torch.empty_like(x)
        if m > 1:
            cfg = gemv.dot_config(m, n, k, gemv.sm_count(x.device), x.element_size())
            cfg.pop("DOT")
            cfg["BLOCK_K"] = min(cfg["BLOCK_K"], ROWS_MAX_K)
            bm = gemv.rows_tile(m, True)
            _add_norm_rows_kernel[(triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, bm))](
                x, add, norm_weight, weight, y, total, m, n, k, weight.stride(0), float(eps), BLOCK_M=bm,
                IEEE=x.dtype == torch.float32, **cfg, **pdl.launch(x.device))
            return y, total
        cfg = gemv.config(1, n, k, gemv.sm_count(x.device))
        _add_norm_gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](x, add, norm_weight, weight, y, total, n, k,
                                                                 weight.stride(0), float(eps), **cfg,
                                                                 **pdl.launch(x.device))
        return y, total

    @gemv_add_norm.register_fake
    def _(x, add, norm_weight, eps, weight):
        return x.new_empty(x.shape[0], weight.shape[0]), torch.empty_like(x)
