"""Paged MLA decode in the absorbed form, as one Triton kernel plus a small torch merge.

Each program owns (sequence, block of heads, split of the context): it walks its split of the
sequence's cached latents through the block table, scores them against the absorbed query
[q_latent | q_pe] and keeps an online softmax, so the context is read once, in place, as
latents (no gather into a padded copy, no per-sequence Python). Splits (flash-decoding) keep
the GPU busy when the batch is small; their partial outputs merge by log-sum-exp.

The split count depends on the batch size only, never on context lengths read from the
device, so a CUDA graph captured for a batch size stays valid for any context. A second small
Triton kernel merges the splits (mla_merge.py; or merges them and applies W_UV: `merge_out`).
The split kernel copies its KV tiles with cp.async; mla_decode_tma.py is the same contract with
TMA copies (a candidate, `LATENTSERVE_MLA_TMA`, for KV blocks of 32 or 64 slots); mla_parts.py
holds what the two share. mla_cuda.py is the same contract in CUDA C for 1-8
sequences in bf16 (`LATENTSERVE_MLA_CUDA_MAX_ROWS`, 8 by default).

Under torch.compile (the decode layers compiled inside the CUDA graphs) the two kernels are one
opaque custom op, `torch.ops.latentserve.mla_decode`: Inductor neither traces the launch nor
analyses which pointers it writes, and the split count stays host arithmetic on a concrete
batch size, so one compiled graph serves every batch size.
"""

from __future__ import annotations

import os

import torch

from . import mla_absorb, mla_cuda, mla_decode_tma, mla_merge, mla_parts, pdl  # noqa: F401 - mla_absorb registers the W_UV op

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU machines: the torch path in attention.py is used
    triton = None

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
BLOCK_H = 16  # tl.dot needs at least 16 rows; fewer heads are masked
# The split count and launch shape by the number of (sequence, head block) programs, from
# bench/mla_decode.py --sweep on the H200 (2026-12-03, 16 heads, context 1024, bf16): 32 splits
# of 32-token steps for one sequence (9.5 -> 8.1 us), 16 of 64 for 8 (16.0 -> 12.0 us), 4 of 32
# with 4 warps at 64 (50.6 -> 43.0 us), and from 256 programs on one split (no merge) with 3
# stages (147.3 us with 4 splits -> 119.0 us at 256). Tried 2026-12-04 and dropped: 3 and 5 stages
# from 64 programs on. The block-table load takes the pipeline's first stages, so the KV tile gets
# one buffer at 3-4 stages and two from 5 (Triton 3.6's TTGIR for sm_90); the sweep's 6-8% for 5
# stages (38.1 against 41.4 us at 64) did not hold in the engine (decode step's split kernel 37.6 ->
# 38.8 us at 64 without PDL, batch 256's step 7.49 -> 7.60 ms; bench/RESULTS.md, runs 28-31).
# Prefetching the block table (PREFETCH_BT) gives the tile 2 buffers at 3 stages: that held in
# the engine (runs 34-37: split kernel 112 -> 95 us at 256, steps 1.03x at 64 and 1.06x at 256).
MAX_SPLITS, MIN_SPLITS, SPLIT_PROGRAMS, ONE_SPLIT_PROGRAMS = 32, 4, 128, 256


def supported(q: torch.Tensor, kv_cache: torch.Tensor, kv_lora_rank: int) -> bool:
    """The kernel runs when Triton can (CUDA, or the interpreter on CPU) and the latent and rope
    widths are powers of two >= 16 (tl.dot and tl.arange need both)."""
    if triton is None or not (q.is_cuda or INTERPRET):
        return False
    rope = kv_cache.shape[-1] - kv_lora_rank

    def pow2(n: int) -> bool:
        return n >= 16 and n & (n - 1) == 0

    return (pow2(kv_lora_rank) and pow2(rope) and q.dtype == kv_cache.dtype
            and q.dtype in (torch.float32, torch.bfloat16, torch.float16))


def _programs(batch: int, num_heads: int) -> int:
    return batch * -(-num_heads // BLOCK_H)


def num_splits(batch: int, num_heads: int) -> int:
    """A power of 2: the split count is a constexpr of both kernels, so each distinct count is a
    compile (~a second). The decode graphs' batches (powers of 2) meet 32, 16, 8, 4 and 1, and any
    other batch (a mixed step's decodes) now reuses one of those, not a count of its own."""
    programs = _programs(batch, num_heads)
    if programs >= ONE_SPLIT_PROGRAMS:
        return 1
    splits = max(MIN_SPLITS, min(MAX_SPLITS, SPLIT_PROGRAMS // programs))
    return 1 << (splits.bit_length() - 1)


def launch_config(batch: int, num_heads: int) -> dict:
    programs = _programs(batch, num_heads)
    # Tried and removed (run 39, 2026-12-04): reading the context length, block table and first
    # KV tile before the PDL wait at batch 1-8 (one tile a program): steps 1.00x at 1 and 8.
    # LATENTSERVE_MLA_SMALL_WARPS (a candidate, 16): ncu at one sequence (run 62) found each warp's
    # chain of ~1600 instructions at 9.3 cycles apart the kernel's length; 16 warps share a tile
    # (1208 instructions a warp, 128 registers, compiled for sm_90) where 8 hold 166 registers.
    warps = int(os.environ.get("LATENTSERVE_MLA_SMALL_WARPS", "8"))
    if programs <= 16 and os.environ.get("LATENTSERVE_MLA_SMALL_PIPELINE", "0") == "1":
        # A candidate (bench/gpu.py's `mla_small_pipeline`): at one tile a program and one stage a
        # program's KV load and its math never overlap. Half-size tiles at 3 stages with the block
        # table a step ahead keep both tiles in flight (2 KV buffers; sm_90, 8 warps: 128 registers
        # at 16-token tiles, 142 at 32, no spills), the first one's math under the second's load.
        return {"BLOCK_N": 16 if programs <= 2 else 32, "num_warps": warps, "num_stages": 3, "PREFETCH_BT": True}
    if programs <= 2:
        return {"BLOCK_N": 32, "num_warps": warps, "num_stages": 1}
    if programs <= 16:
        return {"BLOCK_N": 64, "num_warps": warps, "num_stages": 1}
    if os.environ.get("LATENTSERVE_MLA_PREFETCH", "1") == "0":  # the measured table before it (a baseline)
        return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 3 if programs >= ONE_SPLIT_PROGRAMS else 2}
    # Block tables a step ahead, so the KV tile gets 2 buffers at 3 stages (91 KB of shared
    # memory, 255 registers, 2 programs an SM): the sweep with the KV write and in-order blocks
    # (run 34, 2026-12-04) 41.1 -> 34.8 us at 64 sequences, 121.6 -> 98.2 us at 256. 16-token
    # tiles at 4 stages (3 buffers, 3 programs an SM) lost in the engine: batch 256 1.10x slower.
    # Tried and removed (run 43): 8 warps capped at 128 registers (2 programs of 8 warps an SM, no
    # spills) where ncu had found this one latency-bound: batch 64 1.05x, 256 1.12x slower.
    # LATENTSERVE_MLA_TMA=1: these tiles by TMA copies (mla_decode_tma.py); as fast, not faster
    # (run 101, H100: the step 0.99-1.00x at every batch).
    return {"BLOCK_N": 32, "num_warps": 4, "num_stages": 3, "PREFETCH_BT": True,
            "TMA": os.environ.get("LATENTSERVE_MLA_TMA", "0") == "1"}


if triton is not None:

    @triton.jit
    def _kv_tile(kv_ptr, blk, offs, nmask, stride_slot, d_lat, d_pe, BLOCK_SIZE: tl.constexpr, D_LAT: tl.constexpr):
        slot = blk.to(tl.int64) * BLOCK_SIZE + offs % BLOCK_SIZE
        # Masked loads give 0 for slots past the context: they may hold NaN (poisoned pages).
        k_lat = tl.load(kv_ptr + slot[:, None] * stride_slot + d_lat[None, :], mask=nmask[:, None], other=0.0)
        k_pe = tl.load(kv_ptr + slot[:, None] * stride_slot + D_LAT + d_pe[None, :], mask=nmask[:, None], other=0.0)
        return k_lat, k_pe

    @triton.jit
    def _attend(q_lat, q_pe, k_lat, k_pe, nmask, m_i, l_i, acc, scale, IEEE: tl.constexpr):
        """One tile of the online softmax: (m_i, l_i, acc) after the tile's positions nmask."""
        if IEEE:
            s = tl.dot(q_lat, tl.trans(k_lat), input_precision="ieee")
            s += tl.dot(q_pe, tl.trans(k_pe), input_precision="ieee")
        else:
            s = tl.dot(q_lat, tl.trans(k_lat))
            s += tl.dot(q_pe, tl.trans(k_pe))
        s = tl.where(nmask[None, :], s * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p.to(k_lat.dtype), k_lat, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(k_lat.dtype), k_lat)
        return m_new, l_i, acc

    # stride_bt is the block tables' width, which in a mixed step follows its decodes' longest
    # context: specialized (== 1, % 16), each new class was a compile of ~0.25 s inside a served step.
    @triton.jit(do_not_specialize=["stride_bt"])
    def _mla_decode_split(q_ptr, qpe_ptr, kv_ptr, bt_ptr, ctx_ptr, o_ptr, lse_ptr, new_ptr, new_slot_ptr,
                          cos_ptr, sin_ptr,
                          stride_qb, stride_qh, stride_pb, stride_ph, stride_slot, stride_bt,
                          stride_ob, stride_os, stride_oh, stride_lb, stride_ls, stride_new, stride_cs,
                          num_heads, scale,
                          BLOCK_SIZE: tl.constexpr, D_LAT: tl.constexpr, D_PE: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                          WRITE_KV: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr, PREFETCH_BT: tl.constexpr,
                          ROPE: tl.constexpr = 0):
        """WRITE_KV: the sequence's new token (row b of new_ptr, not yet in the cache) goes to its
        slot in this kernel, which needs no launch of its own: the one split whose range holds its
        position attends it from registers after the loop, which stops before it, and head block 0
        writes it (substituting the row inside the pipelined tile loads cost 36 KB more shared
        memory a program, compiled for sm_90). Writing it before the loop and reading it back with
        the tiles cut ~370 of 1584 SASS instructions at one sequence but no time (runs 60, 62:
        1.01x / 1.00x steps at 1 / 8 sequences, standalone 8.18 -> 7.94 us at 1, H100), so it went.
        PREFETCH_BT: each step loads the next tile's block-table entries, so the KV tile's address
        comes from the step before and Triton's pipeline gives the KV tile num_stages - 1 buffers
        (one at 2-4 stages otherwise: the block-table load took the first stages)."""
        b = tl.program_id(0)
        hblk = tl.program_id(1)
        split = tl.program_id(2)
        d_lat = tl.arange(0, D_LAT)
        d_pe = tl.arange(0, D_PE)
        pdl.enter(PDL)
        ctx, start, loop_end, owns_new = mla_parts.bounds(ctx_ptr, b, split, NUM_SPLITS, BLOCK_N, WRITE_KV)

        heads = hblk * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = heads < num_heads
        q_lat = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d_lat[None, :], mask=hmask[:, None],
                        other=0.0)
        q_pe = mla_parts.query_pe(qpe_ptr, cos_ptr, sin_ptr, b, heads, hmask, stride_pb, stride_ph, stride_cs, D_PE, ROPE)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, D_LAT], tl.float32)
        if PREFETCH_BT:
            blk_next = mla_parts.block_ids(bt_ptr, b, stride_bt, start + tl.arange(0, BLOCK_N), loop_end, BLOCK_SIZE)
        for n0 in range(start, loop_end, BLOCK_N):
            offs = n0 + tl.arange(0, BLOCK_N)
            nmask = offs < loop_end
            if PREFETCH_BT:
                blk = blk_next
                blk_next = mla_parts.block_ids(bt_ptr, b, stride_bt, offs + BLOCK_N, loop_end, BLOCK_SIZE)
            else:
                blk = mla_parts.block_ids(bt_ptr, b, stride_bt, offs, loop_end, BLOCK_SIZE)
            k_lat, k_pe = _kv_tile(kv_ptr, blk, offs, nmask, stride_slot, d_lat, d_pe, BLOCK_SIZE, D_LAT)
            m_i, l_i, acc = _attend(q_lat, q_pe, k_lat, k_pe, nmask, m_i, l_i, acc, scale, IEEE)

        if WRITE_KV:
            if owns_new:  # one more position: the new token, from registers
                new_lat = tl.load(new_ptr + b * stride_new + d_lat)
                new_pe = tl.load(new_ptr + b * stride_new + D_LAT + d_pe)
                s_new = (tl.sum(q_lat.to(tl.float32) * new_lat.to(tl.float32)[None, :], 1)
                         + tl.sum(q_pe.to(tl.float32) * new_pe.to(tl.float32)[None, :], 1)) * scale
                m_new = tl.maximum(m_i, s_new)
                alpha = tl.exp(m_i - m_new)
                p_new = tl.exp(s_new - m_new)
                l_i = l_i * alpha + p_new
                # p rounded to the cache dtype for the value sum, as the tiles' tl.dot takes it
                p_v = p_new.to(new_lat.dtype).to(tl.float32)
                acc = acc * alpha[:, None] + p_v[:, None] * new_lat.to(tl.float32)[None, :]
                m_i = m_new
                if hblk == 0:
                    new_slot = tl.load(new_slot_ptr + b).to(tl.int64)
                    tl.store(kv_ptr + new_slot * stride_slot + d_lat, new_lat)
                    tl.store(kv_ptr + new_slot * stride_slot + D_LAT + d_pe, new_pe)

        # Every split writes both outputs, empty ones (0, -inf), so the merge never reads garbage.
        nonempty = l_i > 0
        out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        lse = tl.where(nonempty, m_i + tl.log(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        o_row = o_ptr + b * stride_ob + split * stride_os + heads[:, None] * stride_oh
        tl.store(o_row + d_lat[None, :], out, mask=hmask[:, None])
        tl.store(lse_ptr + b * stride_lb + split * stride_ls + heads, lse, mask=hmask)


def mla_decode(q_cat: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
               context_lens: torch.Tensor, kv_lora_rank: int, scale: float,
               splits: int | None = None, q_pe: torch.Tensor | None = None,
               new_kv: torch.Tensor | None = None, new_slots: torch.Tensor | None = None,
               w_uv: torch.Tensor | None = None, rope: tuple | None = None) -> torch.Tensor:
    """q_cat [B, H, kv_lora_rank + rope] (absorbed query | roped query), or with q_pe [B, H, rope]
    the absorbed query alone [B, H, kv_lora_rank] (two inputs: no cat); kv_cache
    [num_blocks, block_size, kv_lora_rank + rope]; block_tables [B, W] (any int dtype);
    context_lens [B] >= 1. With new_kv [B, kv_lora_rank + rope] (each sequence's new token, in the
    cache dtype) and new_slots [B], the kernel writes those rows to their slots itself and
    attends them as the last position: what write_kv did before it, one launch fewer.
    Returns the attention output in latent space, [B, H, kv_lora_rank] fp32; with w_uv [H, v,
    kv_lora_rank], that output through W_UV as o_proj's rows [B, H * v] (mla_absorb: the merge and
    the projection in one kernel at a few sequences). rope (cos [B, rope / 2], sin, interleaved): q_pe
    comes unroped and the kernel ropes it where it loads it (`_query_pe`), as layers.apply_rope would."""
    cos, sin, interleave = rope if rope is not None else (None, None, False)
    if splits is None and torch.compiler.is_compiling():
        if new_kv is not None:
            return torch.ops.latentserve.mla_decode_write(q_cat, kv_cache, block_tables, context_lens, kv_lora_rank,
                                                          scale, q_pe, new_kv, new_slots, w_uv, cos, sin, interleave)
        return torch.ops.latentserve.mla_decode(q_cat, kv_cache, block_tables, context_lens, kv_lora_rank, scale,
                                                q_pe, w_uv, cos, sin, interleave)
    return _mla_decode(q_cat, kv_cache, block_tables, context_lens, kv_lora_rank, scale, splits, q_pe=q_pe,
                       new_kv=new_kv, new_slots=new_slots, w_uv=w_uv, rope=rope)


def _mla_decode(q_cat: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                context_lens: torch.Tensor, kv_lora_rank: int, scale: float,
                splits: int | None = None, cfg: dict | None = None, q_pe: torch.Tensor | None = None,
                new_kv: torch.Tensor | None = None, new_slots: torch.Tensor | None = None,
                w_uv: torch.Tensor | None = None, rope: tuple | None = None) -> torch.Tensor:
    """cfg overrides the split kernel's launch shape (BLOCK_N, num_warps, num_stages): the
    sweep in bench/mla_decode.py."""
    if q_pe is None:
        q_pe = q_cat[..., kv_lora_rank:]
    q_lat = q_cat[..., :kv_lora_rank]
    q_lat = q_lat if q_lat.stride(-1) == 1 else q_lat.contiguous()
    q_pe = q_pe if q_pe.stride(-1) == 1 else q_pe.contiguous()
    b, h = q_lat.shape[:2]
    d = kv_lora_rank + q_pe.shape[-1]
    nb, block_size, width = kv_cache.shape
    if (width != d or q_lat.shape[-1] != kv_lora_rank or kv_cache.stride(-1) != 1
            or kv_cache.stride(0) != block_size * kv_cache.stride(1)):
        raise ValueError(f"kv cache {tuple(kv_cache.shape)} strides {kv_cache.stride()} do not fit q "
                         f"{tuple(q_lat.shape)} + rope {tuple(q_pe.shape)}")
    if new_kv is not None:
        if new_kv.shape != (b, d) or new_kv.dtype != kv_cache.dtype or new_slots is None or new_slots.shape != (b,):
            raise ValueError(f"new_kv {tuple(new_kv.shape)} {new_kv.dtype} / new_slots do not fit batch {b}, "
                             f"width {d}, cache {kv_cache.dtype}")
        new_kv = new_kv if new_kv.stride(-1) == 1 else new_kv.contiguous()
    cos, sin = (rope[0], rope[1]) if rope is not None else (context_lens, context_lens)
    if rope is not None and (cos.shape != (b, q_pe.shape[-1] // 2) or sin.shape != cos.shape
                             or cos.stride() != sin.stride() or cos.stride(-1) != 1):
        raise ValueError(f"rope tables {tuple(cos.shape)} / {tuple(sin.shape)} do not fit q_pe {tuple(q_pe.shape)}")
    cuda = cfg is None and mla_cuda.supported(q_lat, q_pe, kv_cache, block_tables, context_lens, new_kv, new_slots, rope)
    splits = splits or (mla_cuda.splits() if cuda else None) or num_splits(b, h)
    o = torch.empty(b, splits, h, kv_lora_rank, dtype=torch.float32, device=q_lat.device)
    lse = torch.empty(b, splits, h, dtype=torch.float32, device=q_lat.device)
    if not (cuda and mla_cuda.split(q_lat, q_pe, kv_cache, block_tables, context_lens, scale, o, lse, new_kv,
                                    new_slots, rope)):
        _launch_split(q_lat, q_pe, kv_cache, block_tables, context_lens, o, lse, new_kv, new_slots, rope, scale,
                      splits, cfg)
    if w_uv is not None:
        if splits == 1:
            return torch.ops.latentserve.mla_absorb_out(o[:, 0], w_uv)
        return mla_merge.merge_out(o, lse, w_uv)
    return o[:, 0] if splits == 1 else mla_merge.merge(o, lse)


def _launch_split(q_lat, q_pe, kv_cache, block_tables, context_lens, o, lse, new_kv, new_slots, rope, scale, splits,
                  cfg) -> None:
    """The Triton split kernel: cp.async tiles, or TMA ones where the launch asks for them and
    `mla_decode_tma.plan` can lay them out."""
    b, h = q_lat.shape[:2]
    block_size = kv_cache.shape[1]
    d = kv_cache.shape[-1]
    kv_lora_rank = q_lat.shape[-1]
    write = new_kv is not None
    cos, sin = (rope[0], rope[1]) if rope is not None else (context_lens, context_lens)
    grid = (b, -(-h // BLOCK_H), splits)
    ieee = q_lat.dtype == torch.float32
    launch = {"PREFETCH_BT": False, **launch_config(b, h), **({"BLOCK_N": 16} if ieee else {}), **(cfg or {})}
    tma = launch.pop("TMA", False) and mla_decode_tma.plan(kv_cache, block_tables, kv_lora_rank, splits,
                                                           launch["BLOCK_N"])
    kernel, caches = _mla_decode_split, (kv_cache,)
    if tma:
        launch.pop("PREFETCH_BT", None)
        kernel, caches = mla_decode_tma._mla_decode_tma, (kv_cache, *tma.pop("descriptors"))
        launch.update(tma)
    kernel[grid](
        q_lat, q_pe, *caches, block_tables, context_lens, o, lse,
        new_kv if write else kv_cache, new_slots if write else context_lens, cos, sin,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1), kv_cache.stride(1), block_tables.stride(0),
        o.stride(0), o.stride(1), o.stride(2), lse.stride(0), lse.stride(1), new_kv.stride(0) if write else 0,
        cos.stride(0), h, scale,
        BLOCK_SIZE=block_size, D_LAT=kv_lora_rank, D_PE=d - kv_lora_rank, BLOCK_H=BLOCK_H,
        NUM_SPLITS=splits, WRITE_KV=int(write), IEEE=ieee,
        ROPE=0 if rope is None else 2 if rope[2] else 1, **launch, **pdl.launch(q_lat.device),
    )


if triton is not None:

    def _fake_out(q_cat, kv_lora_rank, w_uv):
        b, h = q_cat.shape[:2]
        if w_uv is not None:
            return w_uv.new_empty(b, h * w_uv.shape[1])
        return q_cat.new_empty(b, h, kv_lora_rank, dtype=torch.float32)

    def _rope(cos, sin, interleave):
        return (cos, sin, interleave) if cos is not None else None

    @torch.library.custom_op("latentserve::mla_decode", mutates_args=())
    def _mla_decode_op(q_cat: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                       context_lens: torch.Tensor, kv_lora_rank: int, scale: float,
                       q_pe: torch.Tensor | None = None, w_uv: torch.Tensor | None = None,
                       cos: torch.Tensor | None = None, sin: torch.Tensor | None = None,
                       interleave: bool = False) -> torch.Tensor:
        return _mla_decode(q_cat, kv_cache, block_tables, context_lens, kv_lora_rank, scale, q_pe=q_pe,
                           w_uv=w_uv, rope=_rope(cos, sin, interleave)).contiguous()

    @_mla_decode_op.register_fake
    def _(q_cat, kv_cache, block_tables, context_lens, kv_lora_rank, scale, q_pe=None, w_uv=None, cos=None,
          sin=None, interleave=False):
        return _fake_out(q_cat, kv_lora_rank, w_uv)

    # The writing variant is its own op: it mutates the cache, which the read-only op must not
    # declare (a mutated input costs the compiled graph its reordering freedom around the call).
    @torch.library.custom_op("latentserve::mla_decode_write", mutates_args=("kv_cache",))
    def _mla_decode_write_op(q_cat: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                             context_lens: torch.Tensor, kv_lora_rank: int, scale: float, q_pe: torch.Tensor | None,
                             new_kv: torch.Tensor, new_slots: torch.Tensor,
                             w_uv: torch.Tensor | None = None, cos: torch.Tensor | None = None,
                             sin: torch.Tensor | None = None, interleave: bool = False) -> torch.Tensor:
        return _mla_decode(q_cat, kv_cache, block_tables, context_lens, kv_lora_rank, scale, q_pe=q_pe,
                           new_kv=new_kv, new_slots=new_slots, w_uv=w_uv,
                           rope=_rope(cos, sin, interleave)).contiguous()

    @_mla_decode_write_op.register_fake
    def _(q_cat, kv_cache, block_tables, context_lens, kv_lora_rank, scale, q_pe, new_kv, new_slots, w_uv=None,
          cos=None, sin=None, interleave=False):
        return _fake_out(q_cat, kv_lora_rank, w_uv)
