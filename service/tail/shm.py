"""CPU backend of the fused tail: POSIX shared memory between the rank processes of one node.

Each rank creates one /dev/shm segment (its comm region: three mailboxes, protocol.py) and
maps every peer's. Stores go straight into peers' mailboxes; readers poll their own. All
accesses go through views built from the addresses in `peer_ptrs` (named state): the table
is read every call, so losing or corrupting it changes what the kernel does.
Segment names live only until every rank has mapped every segment, then they are unlinked.
"""

from __future__ import annotations

import atexit
import ctypes
import re
import time

import numpy as np
import torch

from ..parallel.shm_segment import Segment, SegmentSizeError, tight_sleep_slack
from .base import latent_norm
from .protocol import (
    BTC,
    CUR,
    DIRTY,
    EMPTY,
    EPOCH,
    EXCHANGES,
    GATHER,
    INITIAL_FLAGS,
    NBUF,
    ROUTED,
    SHARED,
    MailboxLayout,
    TailStateError,
    advanced,
    alloc_state,
    bits_dtype,
    check_inputs,
    clear_elems,
    describe_arrival,
    describe_stale,
    resolve_deadline,
    sentinel,
    timeout_error,
)

# Busy-poll this long before sleeping: peers usually answer within microseconds, but ranks
# may share few cores, and a long spin steals the CPU a peer needs to answer. sched_yield is
# no cheaper a wait: on a busy core it hands over a whole timeslice (milliseconds).
_SPIN_S = 20e-6
_SLEEP_S = 20e-6
_NP_BITS = {torch.int32: np.int32, torch.int16: np.int16}


def segment_name(group_name: str, rank: int) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", group_name)
    return f"latentserve-tail-{safe}-r{rank}"


def _segment(name: str, size: int, create: bool) -> Segment:
    try:
        return Segment(name, size, create)
    except SegmentSizeError as e:
        raise TailStateError(f"{e}: ranks disagree about the tail configuration") from None


class _Mailbox:
    """Views of one exchange's mailbox of one peer, built from peer_ptrs addresses."""

    def __init__(self, payload_addr: int, tags_addr: int, layout: MailboxLayout, ex: int,
                 dtype: torch.dtype):
        tp, width = layout.world_size, layout.width(ex)
        nbytes = layout.payload_bytes(ex)
        raw = (ctypes.c_char * nbytes).from_address(payload_addr)
        shape = (NBUF, tp, layout.max_tokens, width)
        self.bits = np.frombuffer(raw, dtype=_NP_BITS[bits_dtype(dtype)]).reshape(shape)
        self.flat = self.bits.reshape(NBUF, tp, layout.max_tokens * width)
        self.payload = torch.frombuffer(raw, dtype=dtype).view(shape)
        self.tags = np.frombuffer((ctypes.c_int32 * (NBUF * tp)).from_address(tags_addr),
                                  dtype=np.int32).reshape(NBUF, tp)
        # Slot views pre-sliced once: the hot path then only narrows rows.
        self.slots = [[self.payload[b, s] for s in range(tp)] for b in range(NBUF)]


class ShmTailCollective:
    """Fused latent-MoE tail over POSIX shared memory (one instance per rank process)."""

    def __init__(self, rank: int, world_size: int, *, max_tokens: int, latent_dim: int, hidden_dim: int,
                 dtype: torch.dtype, state_alloc, group_name: str, deadline_s: float = 10.0, barrier):
        self.rank, self.world_size = rank, world_size
        self.max_tokens = max_tokens
        self.dtype = dtype
        self.layout = MailboxLayout(world_size, max_tokens, latent_dim, hidden_dim,
                                    torch.empty((), dtype=dtype).element_size())
        self.deadline_s = resolve_deadline(deadline_s)
        self._sent = sentinel(dtype)
        self.routed_flags, self.shared_flags, self.peer_ptrs = alloc_state(state_alloc, world_size)
        if self.routed_flags.device.type != "cpu" or self.peer_ptrs.device.type != "cpu":
            raise ValueError("the shared-memory tail keeps its state in CPU memory")
        self._rflags = self.routed_flags.numpy()
        self._sflags = self.shared_flags.numpy()
        self._table = self.peer_ptrs.numpy()
        self._segments: list[Segment] = []
        self._views: dict[bytes, list[list[_Mailbox]]] = {}
        self._closed = False

        own = _segment(segment_name(group_name, rank), self.layout.total_bytes, create=True)
        self._segments.append(own)
        atexit.register(self.close)
        self._fill_empty(own.base)
        barrier()
        rows = []
        for p in range(world_size):
            seg = own if p == rank else _segment(segment_name(group_name, p), self.layout.total_bytes,
                                                 create=False)
            if p != rank:
                self._segments.append(seg)
            rows.append(self.layout.ptr_row(seg.base))
        self._rows = torch.tensor(rows, dtype=torch.int64)  # the table as built: rearm() restores it
        self.peer_ptrs.copy_(self._rows)
        barrier()
        # Every rank has mapped every segment: the names are no longer needed, and unlinking
        # now means a rank killed without running atexit (e.g. a Ray actor) leaks nothing.
        own.unlink()

    # ---- diagnostics and the negative-control hook ----------------------------
    def epoch(self) -> int:
        return int(self._rflags[EPOCH])

    def state(self) -> dict:
        r, s = self._rflags.tolist(), self._sflags.tolist()
        return {"routed": {"cur": r[CUR], "dirty": r[DIRTY], "epoch": r[EPOCH]},
                "shared": {"cur": s[CUR], "dirty": s[DIRTY], "epoch": s[EPOCH]}}

    def zero_flags(self) -> None:
        """What a wake that lost the flags would leave behind (negative control only)."""
        self.routed_flags.zero_()
        self.shared_flags.zero_()

    def rearm(self) -> None:
        """Re-arm this rank's side after a failed exchange: its own mailboxes refilled (sentinel
        payloads, EMPTY tags), flags back to their initial values, the peer table as built.
        Only while no peer writes (every rank out of its step) and followed by a barrier
        before the next exchange: peers write into these mailboxes."""
        self._fill_empty(self._segments[0].base)
        init = torch.tensor(INITIAL_FLAGS, dtype=torch.int32)
        self.routed_flags.copy_(init)
        self.shared_flags.copy_(init)
        self.peer_ptrs.copy_(self._rows)

    # ---- the collective -------------------------------------------------------
    def fused_tail(self, routed_partial: torch.Tensor, shared_partial: torch.Tensor,
                   norm_weight: torch.Tensor | None, up_weight: torch.Tensor, eps: float) -> torch.Tensor:
        lay, r, tp = self.layout, self.rank, self.world_size
        m = check_inputs(lay, routed_partial, shared_partial, up_weight)
        routed_partial = routed_partial.to(self.dtype)
        shared_partial = shared_partial.to(self.dtype)
        boxes = self._resolve()
        rflags = tuple(self._rflags.tolist())
        sflags = tuple(self._sflags.tolist())
        hs = lay.shard

        self._push(boxes, ROUTED, rflags, m, lambda p: routed_partial)
        self._push(boxes, SHARED, sflags, m, lambda p: shared_partial[:, p * hs:(p + 1) * hs])
        routed = self._wait_reduce(boxes[r][ROUTED], ROUTED, rflags, m)
        latent = latent_norm(routed, norm_weight, eps).to(self.dtype)
        shared = self._wait_reduce(boxes[r][SHARED], SHARED, sflags, m)
        w_shard = up_weight[r * hs:(r + 1) * hs]
        out_shard = torch.matmul(latent, w_shard.t()).float().add_(shared).to(self.dtype)
        self._push(boxes, GATHER, sflags, m, lambda p: out_shard)
        gathered = self._wait(boxes[r][GATHER], GATHER, sflags, m)
        out = torch.empty(m, lay.hidden_dim, dtype=self.dtype)
        out.view(m, tp, hs).copy_(gathered.transpose(0, 1))

        own = boxes[r]
        self._clear(own[ROUTED], ROUTED, rflags)
        self._clear(own[SHARED], SHARED, sflags)
        self._clear(own[GATHER], GATHER, sflags)
        es = lay.elem_size
        self._rflags[:] = advanced(rflags, m * lay.width(ROUTED) * es)
        self._sflags[:] = advanced(sflags, m * hs * es)
        return out

    # ---- steps ----------------------------------------------------------------
    def _resolve(self) -> list[list[_Mailbox]]:
        """Mailbox views for the addresses now in peer_ptrs (built once per distinct table)."""
        key = self._table.tobytes()
        boxes = self._views.get(key)
        if boxes is None:
            boxes = [[self._mailbox(p, ex) for ex in range(len(EXCHANGES))] for p in range(self.world_size)]
            if len(self._views) > 8:  # a table that keeps changing is a bug; don't hoard views
                self._views.clear()
            self._views[key] = boxes
        return boxes

    def _mailbox(self, p: int, ex: int) -> _Mailbox:
        lay = self.layout
        payload, tags = (int(a) for a in self._table[p, 2 * ex:2 * ex + 2])
        for addr, nbytes, what in ((payload, lay.payload_bytes(ex), "payload"),
                                   (tags, lay.tags_bytes(), "tags")):
            if not any(seg.contains(addr, nbytes) for seg in self._segments):
                raise TailStateError(
                    f"fused tail rank {self.rank}: peer_ptrs[{p}] {EXCHANGES[ex]} {what} address "
                    f"{addr:#x} lies in no mapped tail segment (peer table lost or corrupt)")
        return _Mailbox(payload, tags, lay, ex, self.dtype)

    def _push(self, boxes, ex: int, flags, m: int, src_for_peer) -> None:
        cur, epoch, r = flags[CUR], flags[EPOCH], self.rank
        for i in range(self.world_size):
            p = (r + i) % self.world_size  # stagger so ranks don't all hit one peer first
            box = boxes[p][ex]
            if box.tags[cur, r] != EMPTY:
                self._spin(lambda box=box: box.tags[cur, r] == EMPTY, ex, cur, epoch,
                           lambda box=box, p=p: describe_stale(p, r, int(box.tags[cur, r])))
            # x + 0.0 turns a real -0.0 into +0.0 and leaves every other value as it is.
            torch.add(src_for_peer(p), 0.0, out=box.slots[cur][r][:m])
            box.tags[cur, r] = epoch  # after the payload: x86-TSO keeps the store order

    def _arrived(self, box: _Mailbox, cur: int, epoch: int, m: int) -> bool:
        return bool((box.tags[cur] == epoch).all()) and not (box.bits[cur, :, :m] == self._sent).any()

    def _wait(self, box: _Mailbox, ex: int, flags, m: int) -> torch.Tensor:
        cur, epoch = flags[CUR], flags[EPOCH]
        if not self._arrived(box, cur, epoch, m):
            self._spin(lambda: self._arrived(box, cur, epoch, m), ex, cur, epoch,
                       lambda: self._describe_missing(box, cur, epoch, m))
        return box.payload[cur, :, :m]

    def _wait_reduce(self, box: _Mailbox, ex: int, flags, m: int) -> torch.Tensor:
        slots = self._wait(box, ex, flags, m)
        acc = slots[0].float()
        for p in range(1, self.world_size):  # fixed rank order: every rank gets the same bits
            acc.add_(slots[p])
        return acc

    def _clear(self, box: _Mailbox, ex: int, flags) -> None:
        dirty = flags[DIRTY] % NBUF  # zeroed or corrupt flags must not index out of the mailbox
        n = clear_elems(flags[BTC], self.layout, ex)
        if n:
            box.flat[dirty, :, :n] = self._sent
        box.tags[dirty] = EMPTY

    def _describe_missing(self, box: _Mailbox, cur: int, epoch: int, m: int) -> str:
        data_missing = [p for p in range(self.world_size) if (box.bits[cur, p, :m] == self._sent).any()]
        return describe_arrival(box.tags[cur].tolist(), epoch, data_missing)

    def _spin(self, ready, ex: int, buf: int, epoch: int, describe) -> None:
        start = time.perf_counter()
        deadline = start + self.deadline_s
        while True:
            now = time.perf_counter()
            if now - start >= _SPIN_S:
                tight_sleep_slack()
                time.sleep(_SLEEP_S)
            if ready():
                return
            if now > deadline:
                raise timeout_error(self.rank, ex, buf, epoch, self.deadline_s, describe())

    # ---- lifetime -------------------------------------------------------------
    def _fill_empty(self, base: int) -> None:
        lay = self.layout
        for ex in range(len(EXCHANGES)):
            box = _Mailbox(base + lay.payload_offset(ex), base + lay.tags_offset(ex), lay, ex, self.dtype)
            box.bits[...] = self._sent
            box.tags[...] = EMPTY

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._views.clear()
        for seg in self._segments:
            seg.close()
        self._segments = []
        atexit.unregister(self.close)
