"""Triton kernels of the GPU fused tail (protocol.py): push, collect, clear, advance.

Peer mailboxes are reached only through the int64 peer table (cast to pointers in the kernel).
Payloads travel as integer bits, so the sentinel test is exact. Every spin is bounded by a
`%globaltimer` deadline; a kernel that gives up records why in `err` and the host raises.
The only PTX is in `_now` and `_ld_volatile`; with USE_PTX=False (Triton's interpreter)
they fall back to a plain volatile load and an iteration bound.
"""

from __future__ import annotations

import triton
import triton.language as tl

# err[] fields, read by the host (triton_tail.py) to build the TailTimeout message; the
# kernels spell them as literal offsets (Triton reads no plain globals): 0 code, 1 exchange,
# 2 buffer, 3 epoch, 4 mask of peers missing, 5 rank, 6.. tags found per peer.
ERR_CODE, ERR_EX, ERR_BUF, ERR_EPOCH, ERR_MASK, ERR_RANK, ERR_TAGS = 0, 1, 2, 3, 4, 5, 6
ERR_FIELDS = 16
CODE_STALE, CODE_TAGS, CODE_DATA = 1, 2, 3  # writer found a full slot / tags / data missing


@triton.jit
def _now(USE_PTX: tl.constexpr):
    if USE_PTX:
        t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                      is_pure=False, pack=1)
    else:
        t = tl.full([], 0, tl.int64)
    return t


@triton.jit
def _ld_volatile(ptrs, BITS: tl.constexpr, USE_PTX: tl.constexpr):
    """Load that bypasses L1, so a spinning reader sees peers' stores; sign-extended to int32."""
    if USE_PTX:
        if BITS == 16:
            v = tl.inline_asm_elementwise("ld.volatile.global.s16 $0, [$1];", "=r,l", [ptrs],
                                          dtype=tl.int32, is_pure=False, pack=1)
        else:
            v = tl.inline_asm_elementwise("ld.volatile.global.b32 $0, [$1];", "=r,l", [ptrs],
                                          dtype=tl.int32, is_pure=False, pack=1)
    else:
        v = tl.load(ptrs, volatile=True).to(tl.int32)
    return v


@triton.jit
def _await(ptrs, mask, target, ARRIVE_EQ: tl.constexpr, deadline_ns, max_spins,
           BITS: tl.constexpr, USE_PTX: tl.constexpr):
    """Spin until every masked element equals (ARRIVE_EQ) / differs from `target`, or the deadline.

    Returns the values seen and the mask of elements still pending (non-empty = timed out)."""
    v = _ld_volatile(ptrs, BITS, USE_PTX)
    if ARRIVE_EQ:
        pending = (v != target) & mask
    else:
        pending = (v == target) & mask
    n = tl.sum(pending.to(tl.int32), axis=0)
    t0 = _now(USE_PTX)
    spins = 0
    late = (n < 0).to(tl.int32)
    while (n > 0) & (late == 0):
        v = tl.where(pending, _ld_volatile(ptrs, BITS, USE_PTX), v)
        if ARRIVE_EQ:
            pending = (v != target) & mask
        else:
            pending = (v == target) & mask
        n = tl.sum(pending.to(tl.int32), axis=0)
        spins += 1
        late = (((_now(USE_PTX) - t0) > deadline_ns) | (spins > max_spins)).to(tl.int32)
    return v, pending


@triton.jit
def _payload_ptr(addr, BITS: tl.constexpr):
    if BITS == 16:
        p = addr.to(tl.pointer_type(tl.int16))
    else:
        p = addr.to(tl.pointer_type(tl.int32))
    return p


@triton.jit
def _sentinel(BITS: tl.constexpr):
    if BITS == 16:
        s = -32768
    else:
        s = -2147483648
    return s


@triton.jit
def _fail(err, code, ex, buf, epoch, rank, peer_mask):
    """First failure wins the header; every failing program adds its peers to the mask."""
    old = tl.atomic_cas(err + 0, 0, code)
    won = old == 0
    tl.store(err + 1, ex, mask=won)
    tl.store(err + 2, buf, mask=won)
    tl.store(err + 3, epoch, mask=won)
    tl.store(err + 5, rank, mask=won)
    tl.atomic_or(err + 4, peer_mask)


@triton.jit
def push_kernel(src, src_stride, add, add_stride, table, flags, err, rank, m, col_step,
                deadline_ns, max_spins,
                EX: tl.constexpr, WIDTH: tl.constexpr, SLOT: tl.constexpr, TP: tl.constexpr,
                PTR_COLS: tl.constexpr, BITS: tl.constexpr, HAS_ADD: tl.constexpr,
                BLOCK: tl.constexpr, USE_PTX: tl.constexpr):
    """Program p stores this rank's rows into peer p's mailbox[cur] slot `rank`, then its tag.

    src holds payload bits [m, *] (peer p reads columns p*col_step..), or with HAS_ADD a float
    tensor to which the fp32 `add` [m, WIDTH] is added before rounding to the payload dtype."""
    p = tl.program_id(0)
    cur = tl.load(flags + 0) % 3
    epoch = tl.load(flags + 3)
    alive = tl.load(err + 0) == 0
    row = table + p * PTR_COLS
    payload = _payload_ptr(tl.load(row + 2 * EX), BITS)
    tag_ptr = tl.load(row + 2 * EX + 1).to(tl.pointer_type(tl.int32)) + cur * TP + rank

    # Never overwrite unconsumed data: under lost flags this slot stays full and we time out.
    lane = tl.arange(0, 2)
    tags, pend = _await(tag_ptr + lane * 0, (lane == 0) & alive, 0, True, deadline_ns, max_spins, 32, USE_PTX)
    stale = tl.sum(pend.to(tl.int32), axis=0) > 0
    if stale:
        _fail(err, 1, EX, cur, epoch, rank, tl.full([], 1, tl.int32) << p)
        tl.store(err + 6 + p + lane * 0, tags, mask=lane == 0)
    ok = alive & (stale == 0)

    sent = _sentinel(BITS)
    dst = payload + (cur * TP + rank) * SLOT
    n = m * WIDTH
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        msk = (offs < n) & ok
        r = offs // WIDTH
        c = offs % WIDTH
        if HAS_ADD:
            v = tl.load(src + r * src_stride + c, mask=msk, other=0.0).to(tl.float32)
            v += tl.load(add + r * add_stride + c, mask=msk, other=0.0)
            if BITS == 16:
                bits = v.to(tl.bfloat16).to(tl.int16, bitcast=True).to(tl.int32)
            else:
                bits = v.to(tl.int32, bitcast=True)
        else:
            bits = tl.load(src + r * src_stride + p * col_step + c, mask=msk, other=0).to(tl.int32)
        bits = tl.where(bits == sent, 0, bits)  # a real -0.0 travels as +0.0
        tl.store(dst + offs, bits.to(dst.dtype.element_ty), mask=msk)
    # Payload before tag: all threads' stores, then a system-scope release of the tag.
    tl.debug_barrier()
    tl.atomic_xchg(tag_ptr, epoch, mask=ok, sem="release", scope="sys")


@triton.jit
def collect_kernel(out, out_stride, norm_w, table, flags, err, rank, eps, deadline_ns, max_spins,
                   EX: tl.constexpr, WIDTH: tl.constexpr, SLOT: tl.constexpr, TP: tl.constexpr,
                   TP_P2: tl.constexpr, PTR_COLS: tl.constexpr, BITS: tl.constexpr, MODE: tl.constexpr,
                   HAS_NORM: tl.constexpr, BLOCK_W: tl.constexpr, USE_PTX: tl.constexpr):
    """Program = one row of this rank's mailbox[cur]: wait for every sender, then
    MODE 0: sum in rank order (fp32) and RMSNorm (when HAS_NORM) -> out row; MODE 1: sum -> fp32 out row;
    MODE 2: copy sender s's row to out[row, s*WIDTH:(s+1)*WIDTH] (the all-gather).
    Axis 1 tiles the columns BLOCK_W at a time (the device all-gather of a vocab-wide row);
    the norm needs the whole row, so MODE 0 takes one tile (BLOCK_W >= WIDTH)."""
    row = tl.program_id(0)
    col0 = tl.program_id(1) * BLOCK_W
    cur = tl.load(flags + 0) % 3
    epoch = tl.load(flags + 3)
    alive = tl.load(err + 0) == 0
    own = table + rank * PTR_COLS
    payload = _payload_ptr(tl.load(own + 2 * EX), BITS)
    tags = tl.load(own + 2 * EX + 1).to(tl.pointer_type(tl.int32))

    lanes = tl.arange(0, TP_P2)
    tv, tpend = _await(tags + cur * TP + tl.minimum(lanes, TP - 1), (lanes < TP) & alive, epoch, True,
                       deadline_ns, max_spins, 32, USE_PTX)
    tag_mask = tl.sum(tl.where(tpend, tl.full([TP_P2], 1, tl.int32) << lanes, 0), axis=0)
    if tag_mask != 0:
        _fail(err, 2, EX, cur, epoch, rank, tag_mask)
        tl.store(err + 6 + lanes, tv, mask=lanes < TP)
    ok = alive & (tag_mask == 0)

    sent = _sentinel(BITS)
    cols = col0 + tl.arange(0, BLOCK_W)
    in_row = cols < WIDTH
    acc = tl.zeros([BLOCK_W], dtype=tl.float32)
    missing = tl.full([], 0, tl.int32)
    for s in tl.static_range(TP):
        ptrs = payload + (cur * TP + s) * SLOT + row * WIDTH + tl.minimum(cols, WIDTH - 1)
        # After one sender timed out, only look once at the others (for the message).
        dl = tl.where(missing == 0, deadline_ns, 0)
        ms = tl.where(missing == 0, max_spins, 0)
        v, pend = _await(ptrs, in_row & ok, sent, False, dl, ms, BITS, USE_PTX)
        missing |= (tl.sum(pend.to(tl.int32), axis=0) > 0).to(tl.int32) << s
        if BITS == 16:
            f = v.to(tl.int16).to(tl.bfloat16, bitcast=True).to(tl.float32)
        else:
            f = v.to(tl.float32, bitcast=True)
        f = tl.where(in_row, f, 0.0)  # lanes past WIDTH loaded a clamped address
        if MODE == 2:
            tl.store(out + row * out_stride + s * WIDTH + cols, f, mask=in_row)
        else:
            acc += f
    if missing != 0:
        _fail(err, 3, EX, cur, epoch, rank, missing)
    if MODE == 0:
        y = acc
        if HAS_NORM:  # no routed_expert_norm: the latent sum is up-projected as it is
            y = acc * tl.rsqrt(tl.sum(acc * acc, axis=0) / WIDTH + eps)
            y = y * tl.load(norm_w + cols, mask=in_row, other=0.0).to(tl.float32)
        tl.store(out + row * out_stride + cols, y, mask=in_row)
    elif MODE == 1:
        tl.store(out + row * out_stride + cols, acc, mask=in_row)


@triton.jit
def clear_kernel(table, rflags, sflags, rank, R_SLOT: tl.constexpr, S_SLOT: tl.constexpr,
                 TP: tl.constexpr, PTR_COLS: tl.constexpr, BITS: tl.constexpr, ESIZE: tl.constexpr,
                 BLOCK: tl.constexpr):
    """Grid (3 exchanges, TP slots, chunks): re-fill own mailbox[dirty] with the sentinel
    (the first bytes_to_clear of each slot) and set its tags EMPTY."""
    ex = tl.program_id(0)
    s = tl.program_id(1)
    chunk = tl.program_id(2)
    nchunks = tl.num_programs(2)
    is_routed = ex == 0
    dirty = tl.where(is_routed, tl.load(rflags + 1), tl.load(sflags + 1)) % 3
    btc = tl.where(is_routed, tl.load(rflags + 2), tl.load(sflags + 2))
    slot = tl.where(is_routed, R_SLOT, S_SLOT)
    n = tl.minimum((tl.maximum(btc, 0) + ESIZE - 1) // ESIZE, slot)
    own = table + rank * PTR_COLS
    base = _payload_ptr(tl.load(own + 2 * ex), BITS) + (dirty * TP + s) * slot
    sent = _sentinel(BITS)
    for start in range(chunk * BLOCK, n, nchunks * BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(base + offs, (tl.zeros([BLOCK], tl.int32) + sent).to(base.dtype.element_ty), mask=offs < n)
    tags = tl.load(own + 2 * ex + 1).to(tl.pointer_type(tl.int32))
    tl.store(tags + dirty * TP + s, 0, mask=chunk == 0)


@triton.jit
def advance_kernel(rflags, sflags, r_bytes, s_bytes):
    """cur -> dirty, next buffer -> cur, record bytes to clear, epoch + 1 (both flag sets)."""
    cur = tl.load(rflags + 0)
    epoch = tl.load(rflags + 3)
    tl.store(rflags + 0, (cur + 1) % 3)
    tl.store(rflags + 1, cur)
    tl.store(rflags + 2, r_bytes)
    tl.store(rflags + 3, epoch + 1)
    cur = tl.load(sflags + 0)
    epoch = tl.load(sflags + 3)
    tl.store(sflags + 0, (cur + 1) % 3)
    tl.store(sflags + 1, cur)
    tl.store(sflags + 2, s_bytes)
    tl.store(sflags + 3, epoch + 1)
