"""The shared experts' gate/up GEMV with the activation in its epilogue, at one row: one launch
for what is otherwise the GEMV (or cuBLAS) and the activation. Off by default
(LATENTSERVE_GATED_GEMV): its first H200 run took 15 us a shared expert where cuBLAS and the
activation take 8.5. A register product only, on `gemv`'s launch shape with half its K step
(two weight tiles a step)."""

from __future__ import annotations

import os

import torch

from . import act_kernels, gemv, pdl
from .act_kernels import ACTS

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def supported(x: torch.Tensor, weight: torch.Tensor, act: str) -> bool:
    return (os.environ.get("LATENTSERVE_GATED_GEMV", "0") == "1" and gemv.supported(x, weight)
            and x.numel() == x.shape[-1] and act in ACTS)


if triton is not None:

    @triton.jit
    def _gated_gemv_kernel(x_ptr, w_ptr, h_ptr, M, INTER, K, stride_x, stride_w, stride_h, beta, linear_beta,
                           ACT: tl.constexpr, CLIP_UP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_K: tl.constexpr, PDL: tl.constexpr):
        """h = act(x @ gate^T) * (x @ up^T) for W = [gate rows; up rows]: the MLP's first half
        and its activation in one pass over W. Roundings as layers.act_and_mul after a GEMM."""
        pdl.enter(PDL)
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        m = tl.arange(0, BLOCK_M)
        nmask = n < INTER
        mmask = m < M
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        rows = w_ptr + n[:, None].to(tl.int64) * stride_w
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            wmask = nmask[:, None] & kmask[None, :]
            wg = tl.load(rows + k[None, :], mask=wmask, other=0.0).to(tl.float32)
            wu = tl.load(rows + INTER * stride_w + k[None, :], mask=wmask, other=0.0).to(tl.float32)
            xv = tl.load(x_ptr + m[:, None] * stride_x + k[None, :], mask=mmask[:, None] & kmask[None, :],
                         other=0.0).to(tl.float32)
            acc_g += tl.sum(xv[:, None, :] * wg[None, :, :], 2)
            acc_u += tl.sum(xv[:, None, :] * wu[None, :, :], 2)
        dtype = h_ptr.dtype.element_ty
        h = act_kernels.gated(acc_g, acc_u, beta, linear_beta, dtype, ACT, CLIP_UP)
        tl.store(h_ptr + m[:, None] * stride_h + n[None, :], h.to(dtype), mask=mmask[:, None] & nmask[None, :])

    def _gated(x: torch.Tensor, weight: torch.Tensor, act: str, beta: float, linear_beta: float | None):
        k = x.shape[-1]
        x2 = gemv.rows(x)
        m, inter = x2.shape[0], weight.shape[0] // 2
        h = torch.empty(m, inter, dtype=x.dtype, device=x.device)
        # Two weight tiles per step: half the K block of a plain GEMV with the same registers.
        cfg = gemv.config(m, inter, k, gemv.sm_count(x.device))
        cfg["BLOCK_K"] = max(64, cfg["BLOCK_K"] // 2)
        _gated_gemv_kernel[(triton.cdiv(inter, cfg["BLOCK_N"]),)](
            x2, weight, h, m, inter, k, x2.stride(0), weight.stride(0), h.stride(0), float(beta),
            float(linear_beta or 1.0), ACT=ACTS[act], CLIP_UP=linear_beta is not None,
            BLOCK_M=triton.next_power_of_2(m), **cfg, **pdl.launch(x2.device))
        return h.view(*x.shape[:-1], inter)

    @torch.library.custom_op("latentserve::gated_gemv", mutates_args=())
    def gated_gemv(x: torch.Tensor, weight: torch.Tensor, act: str, beta: float,
                   linear_beta: float | None) -> torch.Tensor:
        """x [..., K]; weight [2I, K] (gate rows, then up rows) -> act(gate) * up [..., I]."""
        return _gated(x, weight, act, beta, linear_beta)

    @gated_gemv.register_fake
    def _(x, weight, act, beta, linear_beta):
        return x.new_empty(*x.shape[:-1], weight.shape[0] // 2)
