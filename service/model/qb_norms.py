"""MLA's per-token work between fused_qkv_a and the absorb kernel, at one-row decode steps, in
q_b's GEMV launch (LATENTSERVE_MLA_QB_NORMS=1, a candidate: bench/gpu.py's `qb_norms`).

After fused_qkv_a a layer's compiled code runs q_a's RMS norm and, apart, the latent row the cache
takes: c_kv's RMS norm, the shared key's rope and their concatenation. At one row those are two
Inductor kernels of ~1 us each for a few KB (run 117, H100), on the step's critical path. Here:

- each q_b program reads q_a (1536 values, from L2) and computes its inverse RMS before its
  product, as add_norm.py's fold does for the residual stream (every program reads the whole
  input row anyway);
- one more program of the same launch writes the latent row: c_kv normed, the key roped (DeepSeek's
  halves or interleaved pairs, the products in fp32 as Inductor's rope kernel; Kimi's NoPE copies
  it), nothing else waiting on it until the attention kernel.

Same roundings as the eager ops (rms_norm_hf's two, the GEMV's one) except the rope's, which is
Inductor's. The q rope-and-cat after q_b stays (LATENTSERVE_MLA_ROPE_IN_DECODE moves it into the
attention kernel).
"""

from __future__ import annotations

import os

import torch

from . import add_norm, gemv, pdl
from .kernel_guard import KernelGuard

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


GUARD = KernelGuard("qb_norms")  # a first-call failure turns it off: q_b's GEMV and the compiled norms then


def enabled() -> bool:
    return os.environ.get("LATENTSERVE_MLA_QB_NORMS", "0") == "1" and GUARD.failure is None


def run(*args) -> tuple[torch.Tensor, torch.Tensor] | None:
    """latentserve::mla_qb_norms(*args), or None when its first call in this process fails."""
    return GUARD.call(torch.ops.latentserve.mla_qb_norms, *args)


def supported(qkv_a: torch.Tensor, q_lora: int, kv_lora: int, rope: int, w_qb: torch.Tensor) -> bool:
    """One contiguous row of 16/32-bit qkv_a [1, q_lora + kv_lora + rope], q_b's weight taking q_lora
    on the GEMV, a latent of up to 1024 and an even rope width."""
    return (enabled() and triton is not None and qkv_a.dim() == 2 and qkv_a.shape[0] == 1 and qkv_a.is_contiguous()
            and qkv_a.shape[1] == q_lora + kv_lora + rope and kv_lora <= 1024 and rope % 2 == 0 and rope <= 256
            and gemv.supported(qkv_a[:, :q_lora], w_qb))


if triton is not None:

    @triton.jit
    def _latent(row_ptr, g_ptr, cos_ptr, sin_ptr, out_ptr, KV, R, eps, KV_BLOCK: tl.constexpr,
                HALF_BLOCK: tl.constexpr, ROPE: tl.constexpr):
        """out = [rms_norm(c_kv) | the key roped] from the row's c_kv (at row_ptr) and key after it.
        ROPE: 0 none (NoPE), 1 halves, 2 interleaved pairs (de-interleaved, as layers.apply_rope)."""
        dtype = out_ptr.dtype.element_ty
        c = tl.arange(0, KV_BLOCK)
        cv, inv = add_norm.first_tile(row_ptr, None, KV, eps, KV_BLOCK)
        g = tl.load(g_ptr + c, mask=c < KV, other=0.0)
        tl.store(out_ptr + c, add_norm.norm_of(cv, g, inv, dtype).to(dtype), mask=c < KV)
        j = tl.arange(0, HALF_BLOCK)
        half = R // 2
        jm = j < half
        key = row_ptr + KV
        if ROPE == 0:  # NoPE: the key as it is
            r = tl.arange(0, 2 * HALF_BLOCK)
            tl.store(out_ptr + KV + r, tl.load(key + r, mask=r < R, other=0.0), mask=r < R)
        else:
            if ROPE == 2:
                x1 = tl.load(key + 2 * j, mask=jm, other=0.0).to(tl.float32)
                x2 = tl.load(key + 2 * j + 1, mask=jm, other=0.0).to(tl.float32)
            else:
                x1 = tl.load(key + j, mask=jm, other=0.0).to(tl.float32)
                x2 = tl.load(key + half + j, mask=jm, other=0.0).to(tl.float32)
            cos = tl.load(cos_ptr + j, mask=jm, other=0.0).to(dtype).to(tl.float32)
            sin = tl.load(sin_ptr + j, mask=jm, other=0.0).to(dtype).to(tl.float32)
            tl.store(out_ptr + KV + j, (x1 * cos - x2 * sin).to(dtype), mask=jm)
            tl.store(out_ptr + KV + half + j, (x2 * cos + x1 * sin).to(dtype), mask=jm)

    @triton.jit
    def _qb_norms_kernel(qkv_ptr, gq_ptr, w_ptr, y_ptr, gkv_ptr, cos_ptr, sin_ptr, latent_ptr, N, QA, KV, R,
                         stride_w, eps_q, eps_kv, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         KV_BLOCK: tl.constexpr, HALF_BLOCK: tl.constexpr, ROPE: tl.constexpr, PDL: tl.constexpr):
        """Programs below cdiv(N, BLOCK_N): y[n] = rms_norm(q_a) @ w[n]^T, the first weight tile
        requested before the PDL wait; the last program: the latent row."""
        pid = tl.program_id(0)
        if pid < tl.cdiv(N, BLOCK_N):
            add_norm.normed_rows(qkv_ptr, None, gq_ptr, w_ptr, y_ptr, pid * BLOCK_N + tl.arange(0, BLOCK_N), N, QA,
                                 stride_w, eps_q, BLOCK_K, PDL)
        else:
            pdl.enter(PDL)
            _latent(qkv_ptr + QA, gkv_ptr, cos_ptr, sin_ptr, latent_ptr, KV, R, eps_kv, KV_BLOCK, HALF_BLOCK, ROPE)

    @torch.library.custom_op("latentserve::mla_qb_norms", mutates_args=())
    def qb_norms(qkv_a: torch.Tensor, q_norm: torch.Tensor, q_eps: float, w_qb: torch.Tensor, kv_norm: torch.Tensor,
                 kv_eps: float, cos: torch.Tensor, sin: torch.Tensor, rope: int) -> tuple[torch.Tensor, torch.Tensor]:
        """qkv_a [1, q_lora + kv_lora + r] (fused_qkv_a's row) -> (rms_norm(q_a, q_norm) @ w_qb^T [1, N],
        the latent row [1, kv_lora + r]: rms_norm(c_kv, kv_norm) then the key roped by cos/sin [1, r/2]
        fp32 (rope: 0 none, 1 halves, 2 interleaved))."""
        qa, kv = w_qb.shape[1], kv_norm.shape[0]
        r = qkv_a.shape[1] - qa - kv
        if qkv_a.shape[0] != 1 or r < 0 or (rope and 2 * cos.shape[-1] != r):
            raise ValueError(f"qkv_a {tuple(qkv_a.shape)} is not one row of {qa} + {kv} + the rope's width")
        n = w_qb.shape[0]
        y = torch.empty(1, n, dtype=qkv_a.dtype, device=qkv_a.device)
        latent = torch.empty(1, kv + r, dtype=qkv_a.dtype, device=qkv_a.device)
        cfg = gemv.config(1, n, qa, gemv.sm_count(qkv_a.device))
        grid = (triton.cdiv(n, cfg["BLOCK_N"]) + 1,)
        _qb_norms_kernel[grid](qkv_a, q_norm, w_qb, y, kv_norm, cos if rope else qkv_a, sin if rope else qkv_a,
                               latent, n, qa, kv, r, w_qb.stride(0), float(q_eps), float(kv_eps),
                               KV_BLOCK=triton.next_power_of_2(kv), HALF_BLOCK=max(1, triton.next_power_of_2(r // 2)),
                               ROPE=rope, **cfg, **pdl.launch(qkv_a.device))
        return y, latent

    @qb_norms.register_fake
    def _(qkv_a, q_norm, q_eps, w_qb, kv_norm, kv_eps, cos, sin, rope):
        return qkv_a.new_empty(1, w_qb.shape[0]), qkv_a.new_empty(1, qkv_a.shape[1] - w_qb.shape[1])
