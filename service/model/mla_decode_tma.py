"""The paged MLA decode kernel with its KV tiles fetched by the tensor memory accelerator (sm_90).

ncu on the H100 (run 97, `_mla_decode_split` at 64 and 256 sequences): 255 registers a thread,
2 programs of 4 warps an SM, 0.40 eligible warps a scheduler, DRAM at 60% / 78% of peak, and
~1,000 issued instructions a warp for every 32-token tile: each thread of the cp.async path
computes the slot address and mask of every row it copies. Here one thread issues a tile's copy
as three TMA boxes (the latent's two halves, a box spanning at most 256 elements, then the rope
columns): compiled for sm_90, the tile loop is 479 instructions against 932. Measured on the H100
(bench/RESULTS.md, runs 100-101): 1.01x / 0.98x the cp.async kernel at 64 / 256 sequences, the
decode step 0.99-1.00x: the instructions halve, the time does not move, so it stays opt-in.

A tile must lie inside one cache block (a block size that is a multiple of BLOCK_N: 32 or 64,
as vLLM's MLA backends use, not 16), so its rows are consecutive slots. Splits start on tile
boundaries. The loop covers a split's whole tiles without masks; the positions after the last
whole tile (fewer than BLOCK_N, the usual case) are one masked tile of plain loads, as in
mla_decode.py, so the poisoned slots past a context are never multiplied. The scores and the
value sum are kept in the two latent halves: q_lat·k_lat = q0·k0 + q1·k1, acc = [acc0 | acc1].

Numerics match the plain kernel's: fp32 scores and accumulators, p rounded to the cache dtype
for the value sum; only the order of the score sums differs.
"""

from __future__ import annotations

import torch

from . import mla_parts, pdl

try:
    import triton
    import triton.language as tl
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # CPU machines, or a Triton without tensor descriptors
    triton = None

MAX_BOX = 256  # elements a TMA box may span in one dimension
# Above this many tiles a split (32K positions in 32-token tiles) the ids vector would cost more
# registers and a wider pick each tile than it saves: the cp.async kernel runs instead.
MAX_TILES = 1024


def supported(kv_cache: torch.Tensor, kv_lora_rank: int, block_n: int) -> bool:
    """Tiles inside one cache block, a latent width of two boxes, 16-byte rows."""
    if triton is None:
        return False
    block_size, width = kv_cache.shape[1], kv_cache.shape[2]
    half, rope = kv_lora_rank // 2, width - kv_lora_rank
    return (block_size % block_n == 0 and block_n <= MAX_BOX and 16 <= half <= MAX_BOX and rope <= MAX_BOX
            and (kv_cache.stride(1) * kv_cache.element_size()) % 16 == 0
            and kv_cache.data_ptr() % 16 == 0 and (rope * kv_cache.element_size()) % 16 == 0)


if triton is not None:

    @triton.jit
    def _scores(q0, q1, q_pe, k0, k1, k_pe, IEEE: tl.constexpr):
        if IEEE:
            s = tl.dot(q0, tl.trans(k0), input_precision="ieee")
            s = tl.dot(q1, tl.trans(k1), s, input_precision="ieee")
            return tl.dot(q_pe, tl.trans(k_pe), s, input_precision="ieee")
        s = tl.dot(q0, tl.trans(k0))
        s = tl.dot(q1, tl.trans(k1), s)
        return tl.dot(q_pe, tl.trans(k_pe), s)

    @triton.jit
    def _update(s, k0, k1, m_i, l_i, acc0, acc1, IEEE: tl.constexpr):
        """One tile of the online softmax on scores s: the value sum over both latent halves."""
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        pv = p.to(k0.dtype)
        if IEEE:
            acc0 = tl.dot(pv, k0, acc0 * alpha[:, None], input_precision="ieee")
            acc1 = tl.dot(pv, k1, acc1 * alpha[:, None], input_precision="ieee")
        else:
            acc0 = tl.dot(pv, k0, acc0 * alpha[:, None])
            acc1 = tl.dot(pv, k1, acc1 * alpha[:, None])
        return m_new, l_i * alpha + tl.sum(p, 1), acc0, acc1

    @triton.jit
    def _mla_decode_tma(q_ptr, qpe_ptr, kv_ptr, lat_desc, pe_desc, bt_ptr, ctx_ptr, o_ptr, lse_ptr, new_ptr,
                        new_slot_ptr, cos_ptr, sin_ptr,
                        stride_qb, stride_qh, stride_pb, stride_ph, stride_slot, stride_bt,
                        stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_new, stride_cs,
                        num_heads, scale,
                        BLOCK_SIZE: tl.constexpr, D_LAT: tl.constexpr, D_PE: tl.constexpr,
                        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                        WRITE_KV: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, MAX_TILES: tl.constexpr,
                        ROPE: tl.constexpr = 0):
        """mla_decode._mla_decode_split's contract (outputs, the new token's write) with TMA tiles."""
        HALF: tl.constexpr = D_LAT // 2
        b = tl.program_id(0)
        hblk = tl.program_id(1)
        split = tl.program_id(2)
        dh = tl.arange(0, HALF)
        d_pe = tl.arange(0, D_PE)
        pdl.enter(PDL)
        ctx, start, loop_end, owns_new = mla_parts.bounds(ctx_ptr, b, split, NUM_SPLITS, BLOCK_N, WRITE_KV)
        full_end = start + tl.maximum(loop_end - start, 0) // BLOCK_N * BLOCK_N

        heads = hblk * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < num_heads
        q_row = q_ptr + b * stride_qb + heads[:, None] * stride_qh
        q0 = tl.load(q_row + dh[None, :], mask=hmask[:, None], other=0.0)
        q1 = tl.load(q_row + HALF + dh[None, :], mask=hmask[:, None], other=0.0)
        q_pe = mla_parts.query_pe(qpe_ptr, cos_ptr, sin_ptr, b, heads, hmask, stride_pb, stride_ph, stride_cs,
                                    D_PE, ROPE)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc0 = tl.zeros([BLOCK_H, HALF], tl.float32)
        acc1 = tl.zeros([BLOCK_H, HALF], tl.float32)
        bt_row = bt_ptr + b * stride_bt
        # Every tile's block id, loaded once (MAX_TILES bounds a split's tiles): a copy's coordinate
        # is then arithmetic that Triton's pipeline can issue two tiles ahead. Loaded in the loop, the
        # id stayed a synchronous load before each copy (run 99: 1.11x the cp.async kernel at 256).
        tiles = tl.arange(0, MAX_TILES)
        ids = tl.load(bt_row + (start + tiles * BLOCK_N) // BLOCK_SIZE,
                      mask=start + tiles * BLOCK_N < full_end, other=0)
        for n0 in range(start, full_end, BLOCK_N):
            blk = tl.sum(tl.where(tiles == (n0 - start) // BLOCK_N, ids, 0), 0)
            row = (blk * BLOCK_SIZE + n0 % BLOCK_SIZE).to(tl.int32)  # TMA coordinates are 32-bit: < 2^31 slots
            k0, k1, k_pe = lat_desc.load([row, 0]), lat_desc.load([row, HALF]), pe_desc.load([row, D_LAT])
            m_i, l_i, acc0, acc1 = _update(_scores(q0, q1, q_pe, k0, k1, k_pe, IEEE) * scale, k0, k1, m_i, l_i,
                                           acc0, acc1, IEEE)

        # The positions after the last whole tile (this loop runs at most once), by masked plain loads.
        # As a loop, not an `if`, compiled for sm_90: 44 bytes spilled a thread against 636.
        for n0 in tl.range(full_end, loop_end, BLOCK_N, num_stages=1):
            offs = n0 + tl.arange(0, BLOCK_N)
            nmask = offs < loop_end
            tail = mla_parts.block_ids(bt_ptr, b, stride_bt, offs, loop_end, BLOCK_SIZE)
            rows = kv_ptr + (tail.to(tl.int64) * BLOCK_SIZE + offs % BLOCK_SIZE)[:, None] * stride_slot
            k0 = tl.load(rows + dh[None, :], mask=nmask[:, None], other=0.0)
            k1 = tl.load(rows + HALF + dh[None, :], mask=nmask[:, None], other=0.0)
            k_pe = tl.load(rows + D_LAT + d_pe[None, :], mask=nmask[:, None], other=0.0)
            s = tl.where(nmask[None, :], _scores(q0, q1, q_pe, k0, k1, k_pe, IEEE) * scale, float("-inf"))
            m_i, l_i, acc0, acc1 = _update(s, k0, k1, m_i, l_i, acc0, acc1, IEEE)

        if WRITE_KV:
            if owns_new:  # the new token, from registers (mla_decode.py's epilogue, in halves)
                new_row = new_ptr + b * stride_new
                n0_, n1_, n_pe = tl.load(new_row + dh), tl.load(new_row + HALF + dh), tl.load(new_row + D_LAT + d_pe)
                s_new = (tl.sum(q0.to(tl.float32) * n0_.to(tl.float32)[None, :], 1)
                         + tl.sum(q1.to(tl.float32) * n1_.to(tl.float32)[None, :], 1)
                         + tl.sum(q_pe.to(tl.float32) * n_pe.to(tl.float32)[None, :], 1)) * scale
                m_new = tl.maximum(m_i, s_new)
                alpha = tl.exp(m_i - m_new)
                p_new = tl.exp(s_new - m_new)
                l_i = l_i * alpha + p_new
                p_v = p_new.to(n0_.dtype).to(tl.float32)[:, None]
                acc0 = acc0 * alpha[:, None] + p_v * n0_.to(tl.float32)[None, :]
                acc1 = acc1 * alpha[:, None] + p_v * n1_.to(tl.float32)[None, :]
                m_i = m_new
                if hblk == 0:
                    slot = kv_ptr + tl.load(new_slot_ptr + b).to(tl.int64) * stride_slot
                    tl.store(slot + dh, n0_)
                    tl.store(slot + HALF + dh, n1_)
                    tl.store(slot + D_LAT + d_pe, n_pe)

        nonempty = l_i > 0
        denom = tl.where(nonempty, l_i, 1.0)[:, None]
        lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        o_row = o_ptr + b * stride_ob + split * stride_os + heads[:, None] * stride_oh
        tl.store(o_row + dh[None, :], acc0 / denom, mask=hmask[:, None])
        tl.store(o_row + HALF + dh[None, :], acc1 / denom, mask=hmask[:, None])
        tl.store(lse_ptr + b * stride_lb + split * stride_ls + heads, lse, mask=hmask)

    def max_tiles(block_tables: torch.Tensor, block_size: int, splits: int, block_n: int) -> int:
        """A bound on a split's tiles from the block tables' width: a constexpr, so a power of 2 and at
        least 64, which keeps a mixed step's varying widths to a few compiles (a CUDA graph's is fixed)."""
        per_split = -(-block_tables.shape[1] * block_size // splits)
        return max(64, triton.next_power_of_2(-(-per_split // block_n)))

    def plan(kv_cache: torch.Tensor, block_tables: torch.Tensor, kv_lora_rank: int, splits: int,
             block_n: int) -> dict | None:
        """The TMA kernel's extra launch arguments (its two descriptors, MAX_TILES), or None where the
        cp.async kernel runs: a tile not inside one cache block, or more than MAX_TILES a split."""
        if not supported(kv_cache, kv_lora_rank, block_n):
            return None
        tiles = max_tiles(block_tables, kv_cache.shape[1], splits, block_n)
        if tiles > MAX_TILES:
            return None
        return {"descriptors": descriptors(kv_cache, kv_lora_rank, block_n), "MAX_TILES": tiles}

    def descriptors(kv_cache: torch.Tensor, kv_lora_rank: int, block_n: int) -> tuple:
        """The cache as [slots, width] rows, in tiles of block_n rows: a latent half, the rope columns."""
        nb, block_size, width = kv_cache.shape
        slots = [nb * block_size, width]
        strides = [kv_cache.stride(1), 1]
        return (TensorDescriptor(kv_cache, slots, strides, [block_n, kv_lora_rank // 2]),
                TensorDescriptor(kv_cache, slots, strides, [block_n, width - kv_lora_rank]))
