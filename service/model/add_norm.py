"""A residual add and the RMS norm after it, folded into the projection that reads the normed row
at one-row decode steps: fused_qkv_a's GEMV for the input norm, the MoE entry kernel for the
post-attention norm (LATENTSERVE_FOLD_ADD_NORM, on by default; `0`: bench/gpu.py's
`fold_add_norm_off`).

At batch 1 each of a decoder layer's two add + norm kernels (Inductor's) costs ~1.8 us for a few
KB of reads (run 45): fixed latency, not bytes. Every program of the projection after it reads the
whole normed row from L2 anyway, so it can as well read the stream and the pending sublayer
output, add, norm and multiply; one program writes the sum back as the new stream. A program
first sums the row's squares (its first tile stays in registers), with the unfused ops'
roundings: the add rounded to the model dtype, then rms_norm_hf's two. Batch 1 0.95x (run 105)
and 0.96x (run 106), both H100.

One row only. From 2 rows the projections are tensor-core tiles, and in Triton 3.6's pipeline any
use of the activation tile besides the dot costs more than the kernel it would save
(bench/norm_in_loop.py, runs 107-108, H100, 8 rows, a 2112 x 2048 weight: the GEMV 4.1 us; the
same loop with the row's sums of squares in it 14, with x + add too 24, with the new stream stored
inside the loop 23 where after it 6.6; the best whole fold, a pass for the norm first, 11.1
against 4.1 + ~1.8 unfused). A 2-16 row variant with the norm factored out of the product ran
28 us a call (run 105: batch 8 1.37x) and is gone.

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

GUARD = KernelGuard("add_norm")  # a first-call failure turns the fold off: the compiled add + norm then


def enabled(x: torch.Tensor, add: torch.Tensor | None) -> bool:
    """The switch on, and x, add contiguous [1, K] of one dtype on a kernel device."""
    return (os.environ.get("LATENTSERVE_FOLD_ADD_NORM", "1") == "1" and triton is not None and GUARD.failure is None
            and add is not None and (x.is_cuda or gemv.INTERPRET) and x.dim() == 2 and x.shape[0] == 1
            and add.shape == x.shape and add.dtype == x.dtype and x.is_contiguous() and add.is_contiguous())


def gemv_supported(x: torch.Tensor, add: torch.Tensor | None, weight: torch.Tensor) -> bool:
    return enabled(x, add) and gemv.supported(x, weight)


def run(op, *args):
    """op(*args), or None when its first call in this process fails (`KernelGuard`)."""
    return GUARD.call(op, *args)


if triton is not None:

    @triton.jit
    def row_sum(x_ptr, add_ptr, k, kmask):
        """x + add at columns k, rounded to x's dtype as the add alone rounds, in fp32; add_ptr None:
        x alone (a norm with no add before it, qb_norms.py)."""
        x = tl.load(x_ptr + k, mask=kmask, other=0.0)
        s = x.to(tl.float32)
        if add_ptr is not None:
            a = tl.load(add_ptr + k, mask=kmask, other=0.0)
            s = (s + a.to(tl.float32)).to(x.dtype).to(tl.float32)
        return s

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
    def normed_rows(x_ptr, add_ptr, g_ptr, w_ptr, y_ptr, n, N, K, stride_w, eps, BLOCK_K: tl.constexpr,
                    PDL: tl.constexpr):
        """y[n] = rms_norm(x + add) @ w[n]^T for one row (add_ptr None: rms_norm(x)), as gemv's
        register product. The first weight tile is requested before the PDL wait."""
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

    @triton.jit
    def _add_norm_gemv_kernel(x_ptr, add_ptr, g_ptr, w_ptr, y_ptr, sum_ptr, N, K, stride_w, eps,
                              BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """y = rms_norm(x + add) @ w^T for one row; program 0 also writes x + add."""
        normed_rows(x_ptr, add_ptr, g_ptr, w_ptr, y_ptr, tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N), N, K,
                    stride_w, eps, BLOCK_K, PDL)
        if tl.program_id(0) == 0:
            store_sum(x_ptr, add_ptr, sum_ptr, K, BLOCK_K)

    @torch.library.custom_op("latentserve::gemv_add_norm", mutates_args=())
    def gemv_add_norm(x: torch.Tensor, add: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x, add [1, K] -> (rms_norm(x + add, norm_weight, eps) @ weight^T [1, N], x + add [1, K])."""
        (m, k), n = x.shape, weight.shape[0]
        if m != 1:
            raise ValueError(f"the add-norm fold takes one row, not {m}")
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        total = torch.empty_like(x)
        cfg = gemv.config(1, n, k, gemv.sm_count(x.device))
        _add_norm_gemv_kernel[(triton.cdiv(n, cfg["BLOCK_N"]),)](x, add, norm_weight, weight, y, total, n, k,
                                                                 weight.stride(0), float(eps), **cfg,
                                                                 **pdl.launch(x.device))
        return y, total

    @gemv_add_norm.register_fake
    def _(x, add, norm_weight, eps, weight):
        return x.new_empty(x.shape[0], weight.shape[0]), torch.empty_like(x)
