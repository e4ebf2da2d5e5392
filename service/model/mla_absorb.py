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

from . import gemv, pdl

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


def wide_k_max_rows() -> int:
    """Up to this many sequences a program reads its head's weight slice in K steps of up to 256
    (W_UK's 128: all of it) rather than 64, the first before the PDL wait, as the one-row GEMV's
    whole-K slices do since run 39 (0.95x at batch 1). LATENTSERVE_MLA_ABSORB_WIDE_K_MAX_ROWS (0:
    64-wide steps throughout, bench/gpu.py's `absorb_narrow_k`); 16 by default since run 47
    (2026-12-05, H200): the decode step at batch 8 took 3.060 ms with it, 3.148 without in the same
    run (0.97x), batch 1 1.732 against run 46's 1.795. 16 at most: sm_90 compiles of a 16-row block
    hold 112 (W_UK) and 200 (W_UV, fp32 input) registers without spills; W_UV's whole 512 in one
    step spills 380 bytes."""
    return min(16, int(os.environ.get("LATENTSERVE_MLA_ABSORB_WIDE_K_MAX_ROWS", "16")))


def _steps(batch: int, k: int, block_j: int) -> tuple[int, int]:
    """(BLOCK_K, BLOCK_J). Wide K steps hold twice the weight a program, so each program takes
    half the outputs and the grid covers twice the SMs (W_UV's 16 heads x 128: 128 programs)."""
    if batch <= wide_k_max_rows():
        return min(256, triton.next_power_of_2(k)), max(16, block_j // 2)
    return 64, block_j


def l2_tiles_enabled() -> bool:
    """LATENTSERVE_MLA_ABSORB_L2_TILES=1 (bench/gpu.py's `absorb_l2_tiles`; run 58: 1.00-1.01x):
    above the wide-K rows, `l2_tiles` chooses the sequences and outputs a program instead of 64 x
    64 / 32."""
    return os.environ.get("LATENTSERVE_MLA_ABSORB_L2_TILES", "0") == "1"


def l2_tiles(b: int, h: int, k: int, j: int, x_bytes: int, w_bytes: int, sms: int) -> tuple[int, int]:
    """(BLOCK_B, BLOCK_J) with the fewest bytes through the busiest SM: each program reads its rows
    of x (every K) and its head's K x BLOCK_J weight slice from L2, and an SM runs ceil(programs /
    SMs) of them. That count explained the 64-row GEMV (6.1 us for fused_qkv_a: 320 KB a program
    at ~55 KB/us an SM; bench/RESULTS.md). W_UV at 64 rows (fp32 x, 64 x 32 tiles): 64 programs
    of 160 KB; 16 x 64: 128 of 96 KB. Ties: fewer programs."""
    best = None
    for bb in (16, 32, 64):
        if bb > 16 and bb // 2 >= b:
            continue
        for bj in (16, 32, 64, 128):
            if bj > max(16, triton.next_power_of_2(j)) or bb * bj > 8192:
                continue
            programs = triton.cdiv(b, bb) * h * triton.cdiv(j, bj)
            cost = triton.cdiv(programs, sms) * (min(bb, b) * k * x_bytes + k * bj * w_bytes)
            if best is None or (cost, programs) < best[0]:
                best = ((cost, programs), bb, bj)
    return best[1], best[2]


if triton is not None:

    # B is a step's decode count: specialized (== 1, % 16) and with BLOCK_B, a mixed step with
    # a count the startup warm-up had not met compiled two kernels (~0.8 s) inside the step.
    @triton.jit(do_not_specialize=["B"])
    def _per_head_kernel(x_ptr, w_ptr, out_ptr, gate_ptr, B, K, J, stride_xb, stride_xh, stride_wh, stride_wk,
                         stride_wj, stride_ob, stride_oh, stride_gb, IEEE: tl.constexpr, BLOCK_B: tl.constexpr,
                         BLOCK_K: tl.constexpr, BLOCK_J: tl.constexpr, PDL: tl.constexpr, GATE: tl.constexpr = False):
        """Program (block of sequences, head, block of outputs): out[rows, h, j] = x[rows, h] (rounded
        to the weight's dtype) @ w[h][:, j], any strides on w's two matrix dims, so W_UK [H, nope,
        lora] and W_UV [H, v, lora] (read transposed) both serve. The weight's first K step is
        loaded before the PDL wait (as in gemv.py). GATE: times sigmoid(gate) (out's layout, its own row stride),
        each factor rounded to out's dtype first, as Kimi's output gate multiplies them in torch."""
        rows = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
        h = tl.program_id(1).to(tl.int64)
        j = tl.program_id(2) * BLOCK_J + tl.arange(0, BLOCK_J)
        rmask, jmask = rows < B, j < J
        dtype = w_ptr.dtype.element_ty
        x_rows = x_ptr + rows[:, None] * stride_xb + h * stride_xh
        w_cols = w_ptr + h * stride_wh + j[None, :] * stride_wj
        k = tl.arange(0, BLOCK_K)
        w0 = tl.load(w_cols + k[:, None] * stride_wk, mask=(k < K)[:, None] & jmask[None, :], other=0.0)
        pdl.enter(PDL)
        x0 = tl.load(x_rows + k[None, :], mask=rmask[:, None] & (k < K)[None, :], other=0.0).to(dtype)
        if IEEE:
            acc = tl.dot(x0, w0, input_precision="ieee")
        else:
            acc = tl.dot(x0, w0)
        for k0 in range(BLOCK_K, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            kmask = k < K
            xv = tl.load(x_rows + k[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0).to(dtype)
            wv = tl.load(w_cols + k[:, None] * stride_wk, mask=kmask[:, None] & jmask[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(xv, wv, input_precision="ieee")
            else:
                acc += tl.dot(xv, wv)
        at = rows[:, None] * stride_ob + h * stride_oh + j[None, :]
        y = acc.to(out_ptr.dtype.element_ty)
        if GATE:
            g = tl.load(gate_ptr + rows[:, None] * stride_gb + h * stride_oh + j[None, :],
                        mask=rmask[:, None] & jmask[None, :], other=0.0).to(tl.float32)
            y = (y.to(tl.float32) * tl.sigmoid(g).to(out_ptr.dtype.element_ty).to(tl.float32)).to(y.dtype)
        tl.store(out_ptr + at, y, mask=rmask[:, None] & jmask[None, :])

    def _per_head(x: torch.Tensor, w: torch.Tensor, k_dim: int, out: torch.Tensor, stride_ob: int, stride_oh: int,
                  block_j: int, gate: torch.Tensor | None = None) -> torch.Tensor:
        """out rows of x [B, H, K] against each head's w[h] with its K dim `k_dim` (1 or 2)."""
        b, h, k = x.shape
        j_dim = 3 - k_dim
        if b == 0:
            return out
        bb = _rows_block(b)
        block_k, block_j = _steps(b, k, block_j)
        if b > wide_k_max_rows() and l2_tiles_enabled():
            bb, block_j = l2_tiles(b, h, k, w.shape[j_dim], x.element_size(), w.element_size(), gemv.sm_count(x.device))
        _per_head_kernel[(triton.cdiv(b, bb), h, triton.cdiv(w.shape[j_dim], block_j))](
            x, w, out, gate if gate is not None else out, b, k, w.shape[j_dim], x.stride(0), x.stride(1), w.stride(0),
            w.stride(k_dim), w.stride(j_dim), stride_ob, stride_oh, gate.stride(0) if gate is not None else 0,
            IEEE=w.dtype == torch.float32, BLOCK_B=bb,
            BLOCK_K=block_k, BLOCK_J=block_j, GATE=gate is not None, num_warps=4, num_stages=2,
            **pdl.launch(x.device))
        return out

    def _absorb_q(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        out = torch.empty(x.shape[0], x.shape[1], w.shape[2], dtype=x.dtype, device=x.device)
        return _per_head(x, w, 1, out, out.stride(0), out.stride(1), 64)

    def _absorb_out(o: torch.Tensor, w: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        h, v = w.shape[:2]
        out = torch.empty(o.shape[0], h * v, dtype=w.dtype, device=o.device)
        if gate is not None and (gate.shape != out.shape or gate.stride(-1) != 1):
            raise ValueError(f"output gate {tuple(gate.shape)} {gate.stride()} is not laid out as o_proj's rows "
                             f"{tuple(out.shape)}")
        return _per_head(o, w, 2, out, out.stride(0), v, 32, gate)

    @torch.library.custom_op("latentserve::mla_absorb_q", mutates_args=())
    def absorb_q(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
        """q_nope [B, H, nope] (any row strides) @ w_uk [H, nope, kv_lora_rank] -> [B, H, kv_lora_rank]."""
        return _absorb_q(q_nope, w_uk)

    @absorb_q.register_fake
    def _(q_nope, w_uk):
        return q_nope.new_empty(q_nope.shape[0], q_nope.shape[1], w_uk.shape[2])

    @torch.library.custom_op("latentserve::mla_absorb_out", mutates_args=())
    def absorb_out(o_latent: torch.Tensor, w_uv: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        """o_latent [B, H, kv_lora_rank] (fp32 or the model dtype) against w_uv [H, v, kv_lora_rank]
        -> [B, H * v] in w_uv's dtype: o_proj's input rows; with gate [B, H * v] (any row stride, Kimi's
        output gate before its sigmoid), those rows times sigmoid(gate)."""
        return _absorb_out(o_latent, w_uv, gate)

    @absorb_out.register_fake
    def _(o_latent, w_uv, gate=None):
        return w_uv.new_empty(o_latent.shape[0], o_latent.shape[1] * w_uv.shape[1])
