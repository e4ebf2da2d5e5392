"""The pieces both MLA split kernels share (mla_decode.py's cp.async tiles, mla_decode_tma.py's TMA
tiles): a split's bounds in a sequence, the cache blocks of its positions, the roped query."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines
    triton = None

if triton is not None:

    @triton.jit
    def block_ids(bt_ptr, b, stride_bt, offs, end, BLOCK_SIZE: tl.constexpr):
        """The cache blocks holding sequence b's positions offs (0 from `end` on)."""
        return tl.load(bt_ptr + b * stride_bt + offs // BLOCK_SIZE, mask=offs < end, other=0)

    @triton.jit
    def bounds(ctx_ptr, b, split, NUM_SPLITS: tl.constexpr, BLOCK_N: tl.constexpr, WRITE_KV: tl.constexpr):
        """(context, this split's first position, where its tile loop stops, whether it owns the
        new token). Splits start on BLOCK_N boundaries; trailing splits may be empty."""
        ctx = tl.load(ctx_ptr + b)
        per_split = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
        start = split * per_split
        end = tl.minimum(start + per_split, ctx)
        owns_new = (start <= ctx - 1) & (ctx - 1 < end)
        loop_end = tl.minimum(end, ctx - 1) if WRITE_KV else end
        return ctx, start, loop_end, owns_new

    @triton.jit
    def query_pe(qpe_ptr, cos_ptr, sin_ptr, b, heads, hmask, stride_pb, stride_ph, stride_cs,
                  D_PE: tl.constexpr, ROPE: tl.constexpr):
        """Sequence b's q_pe rows [BLOCK_H, D_PE], roped here when ROPE (1: halves, 2: DeepSeek's
        interleaved pairs, de-interleaved as layers.apply_rope leaves them and the cache holds
        k_pe): cos/sin [B, D_PE / 2] rounded to q's dtype, the products summed in fp32 and the
        result rounded to q's dtype, as the compiled layer's rope kernel computes it."""
        d = tl.arange(0, D_PE)
        rows = qpe_ptr + b * stride_pb + heads[:, None] * stride_ph
        if ROPE == 0:
            return tl.load(rows + d[None, :], mask=hmask[:, None], other=0.0)
        half = D_PE // 2
        j = d % half
        first = d < half
        if ROPE == 2:
            x1_at, x2_at = 2 * j, 2 * j + 1
        else:
            x1_at, x2_at = j, j + half
        x1 = tl.load(rows + x1_at[None, :], mask=hmask[:, None], other=0.0)
        x2 = tl.load(rows + x2_at[None, :], mask=hmask[:, None], other=0.0)
        c = tl.load(cos_ptr + b * stride_cs + j).to(x1.dtype).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + b * stride_cs + j).to(x1.dtype).to(tl.float32)[None, :]
        a, o = x1.to(tl.float32), x2.to(tl.float32)
        return tl.where(first[None, :], a * c - o * s, o * c + a * s).to(x1.dtype)
