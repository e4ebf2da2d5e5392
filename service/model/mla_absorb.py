"""MLA decode's two absorbed projections as Triton kernels, in the layouts their neighbours want.

The absorbed decode (attention.MLAAttention._absorbed_decode) maps each head's query through W_UK
into the latent space, attends there (mla_decode), and maps the result back through W_UV. As
torch ops in a compiled decoder layer that was seven kernels a layer: a cuBLAS bmm, a cat of
[q_latent | q_pe] for the attention kernel, the split and merge kernels, a cast of the fp32
result, a second bmm, and a copy of its [heads, batch, v] result into the [batch, heads * v]
rows o_proj reads (bench/RESULTS.md: 26 kernels a layer at batch 1, the goal is 20). Here:

- `absorb_q`: q_latent[b, h] = q_nope[b, h] @ W_UK[h], read from the roped query in place and
  written [batch, heads, kv_lora_rank]; the attention kernel takes it and q_pe as two inputs.
- `absorb_out`: out[b, h * v_dim:(h + 1) * v_dim] = o_latent[b, h] @ W_UV[h]^T, reading the
  attention's fp32 output (rounded to the model dtype first, as the torch path's cast does) and
  writing o_proj's rows directly.

Both are tensor-core GEMMs over a block of sequences per program (tl.dot needs 16 rows; at batch
1 the others are masked) with fp32 accumulation, rounded once to the model dtype like the bmm
they replace. `torch.library` custom ops: compiled layers keep them opaque, CUDA graphs capture
them. `supported` decides; the torch bmm's stay the fallback.
"""

from __future__ import annotations

import os

import torch

from . import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: attention.py keeps the bmm's
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def enabled() -> bool:
    """LATENTSERVE_MLA_ABSORB=0 keeps the bmm's (the bench's baseline)."""
    return os.environ.get("LATENTSERVE_MLA_ABSORB", "1") != "0"


def supported(q: torch.Tensor, weight: torch.Tensor) -> bool:
    return (triton is not None and enabled() and (q.is_cuda or INTERPRET) and q.dtype in _DTYPES
            and weight.dtype == q.dtype and q.stride(-1) == 1 and weight.stride(-1) == 1)


def _rows_block(batch: int) -> int:
    return 16 if batch <= 16 else 32 if batch <= 32 else 64


if triton is not None:

    @triton.jit
    def _absorb_q_kernel(x_ptr, w_ptr, out_ptr, B, N, D, stride_xb, stride_xh, stride_wh, stride_wn,
                         stride_ob, stride_oh, IEEE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        """Program (block of sequences, head, block of latent dims): out = x[rows, h] @ w[h].
        The weight's first K step is loaded before the PDL wait (as in gemv.py)."""
        rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        h = tl.program_id(1).to(tl.int64)
        d = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
        rmask, dmask = rows < B, d < D
        n = tl.arange(0, BLOCK_K)
        w0 = tl.load(w_ptr + h * stride_wh + n[:, None] * stride_wn + d[None, :], mask=(n < N)[:, None] & dmask[None, :],
                     other=0.0)
        pdl.enter(PDL)
        x0 = tl.load(x_ptr + rows[:, None] * stride_xb + h * stride_xh + n[None, :],
                     mask=rmask[:, None] & (n < N)[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(x0, w0, input_precision="ieee")
        else:
            acc = tl.dot(x0, w0)
        for n0 in range(BLOCK_K, N, BLOCK_K):
            n = n0 + tl.arange(0, BLOCK_K)
            nmask = n < N
            xv = tl.load(x_ptr + rows[:, None] * stride_xb + h * stride_xh + n[None, :],
                         mask=rmask[:, None] & nmask[None, :], other=0.0)
            wv = tl.load(w_ptr + h * stride_wh + n[:, None] * stride_wn + d[None, :],
                         mask=nmask[:, None] & dmask[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(xv, wv, input_precision="ieee")
            else:
                acc += tl.dot(xv, wv)
        tl.store(out_ptr + rows[:, None] * stride_ob + h * stride_oh + d[None, :],
                 acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])

    @triton.jit
    def _absorb_out_kernel(o_ptr, w_ptr, out_ptr, B, V, D, stride_ob, stride_oh, stride_wh, stride_wv,
                           stride_out, IEEE: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K: tl.constexpr,
                           BLOCK_V: tl.constexpr, PDL: tl.constexpr):
        """Program (block of sequences, head, block of v dims): out[rows, h * V + v] =
        o[rows, h] (rounded to the weight's dtype) @ w[h, v]^T. The weight's first K step is
        loaded before the PDL wait."""
        rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        h = tl.program_id(1).to(tl.int64)
        v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
        rmask, vmask = rows < B, v < V
        dtype = w_ptr.dtype.element_ty
        d = tl.arange(0, BLOCK_K)
        w0 = tl.load(w_ptr + h * stride_wh + v[None, :] * stride_wv + d[:, None], mask=(d < D)[:, None] & vmask[None, :],
                     other=0.0)
        pdl.enter(PDL)
        o0 = tl.load(o_ptr + rows[:, None] * stride_ob + h * stride_oh + d[None, :],
                     mask=rmask[:, None] & (d < D)[None, :], other=0.0).to(dtype)
        if IEEE:
            acc = tl.dot(o0, w0, input_precision="ieee")
        else:
            acc = tl.dot(o0, w0)
        for d0 in range(BLOCK_K, D, BLOCK_K):
            d = d0 + tl.arange(0, BLOCK_K)
            dmask = d < D
            ov = tl.load(o_ptr + rows[:, None] * stride_ob + h * stride_oh + d[None, :],
                         mask=rmask[:, None] & dmask[None, :], other=0.0).to(dtype)
            wv = tl.load(w_ptr + h * stride_wh + v[None, :] * stride_wv + d[:, None],
                         mask=dmask[:, None] & vmask[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(ov, wv, input_precision="ieee")
            else:
                acc += tl.dot(ov, wv)
        tl.store(out_ptr + rows[:, None] * stride_out + h * V + v[None, :], acc.to(dtype),
                 mask=rmask[:, None] & vmask[None, :])

    def _absorb_q(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        b, h, n = x.shape
        d = w.shape[2]
        out = torch.empty(b, h, d, dtype=x.dtype, device=x.device)
        if b == 0:
            return out
        bb, bd = _rows_block(b), 64
        _absorb_q_kernel[(triton.cdiv(b, bb), h, triton.cdiv(d, bd))](
            x, w, out, b, n, d, x.stride(0), x.stride(1), w.stride(0), w.stride(1), out.stride(0), out.stride(1),
            IEEE=x.dtype == torch.float32, BLOCK_B=bb, BLOCK_K=64, BLOCK_D=bd, num_warps=4, num_stages=2,
            **pdl.launch(x.device))
        return out

    def _absorb_out(o: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        b, h, d = o.shape
        v = w.shape[1]
        out = torch.empty(b, h * v, dtype=w.dtype, device=o.device)
        if b == 0:
            return out
        bb, bv = _rows_block(b), 32
        _absorb_out_kernel[(triton.cdiv(b, bb), h, triton.cdiv(v, bv))](
            o, w, out, b, v, d, o.stride(0), o.stride(1), w.stride(0), w.stride(1), out.stride(0),
            IEEE=w.dtype == torch.float32, BLOCK_B=bb, BLOCK_K=64, BLOCK_V=bv, num_warps=4, num_stages=2,
            **pdl.launch(o.device))
        return out

    @torch.library.custom_op("latentserve::mla_absorb_q", mutates_args=())
    def absorb_q(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
        """q_nope [B, H, nope] (any row strides) @ w_uk [H, nope, kv_lora_rank] -> [B, H, kv_lora_rank]."""
        return _absorb_q(q_nope, w_uk)

    @absorb_q.register_fake
    def _(q_nope, w_uk):
        return q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uk.shape[2])

    @torch.library.custom_op("latentserve::mla_absorb_out", mutates_args=())
    def absorb_out(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        """o_latent [B, H, kv_lora_rank] (fp32 or the model dtype) against w_uv [H, v, kv_lora_rank]
        -> [B, H * v] in w_uv's dtype: o_proj's input rows."""
        return _absorb_out(o_latent, w_uv)

    @absorb_out.register_fake
    def _(o_latent, w_uv):
        return w_uv.new_empty(o_latent.shape[0], o_latent.shape[1] * w_uv.shape[1])
