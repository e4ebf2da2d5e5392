"""The TP collectives of the ranks of one node over POSIX shared memory (all-reduce, all-gather,
broadcast of the step plan), instead of gloo over loopback TCP.

Each rank owns one /dev/shm segment: two counters and two data slots. Every rank runs the same
collectives in the same order, so op n is the same op everywhere; it uses slot n % 2.

    ready[r] = n  rank r's data for op n is in its slot n % 2 (stored after the data)
    done[r]  = n  rank r has finished reading op n

A rank writes slot n % 2 only once every rank's done >= n - 2 (the last op on that slot), then
publishes ready; readers wait for the ready counters they need. An all-reduce sums the slots in
rank order in fp32, so every rank gets the same bits. Payloads larger than a slot go in pieces,
each its own op. Stores are ordered on x86-64 (TSO), as the fused tail already relies on.

Every wait has a deadline (a step's collectives) or none (a follower idle between plans); a
peer that died shows up as the deadline's error, naming the rank and the op.

After a failed step the ranks may have stopped at different ops. `resync()` realigns them:
a rank announces a new generation in its header, which ends every peer's pending wait with
`GroupResync`; once every rank has joined, all agree on a fresh op number above any counter
ever published, so no stale ready or done can be taken for a new op.
"""

from __future__ import annotations

import atexit
import os
import threading
import time

import numpy as np
import torch

from .shm_segment import Segment, tight_sleep_slack

_HEADER = 64  # ready, done, gen, gen_ack: int64 each, on their own cache line
READY, DONE, GEN, GEN_ACK = 0, 1, 2, 3
SLOT_BYTES = int(os.environ.get("LATENTSERVE_SHM_SLOT_BYTES", 4 << 20))
# Busy-poll briefly (peers usually answer within microseconds), then sleep in short steps: ranks
# may share few cores, and spinning would steal the CPU a peer needs to answer. Ranks with cores
# of their own (`set_cpu_threads` pinned them) poll longer, yielding the core between polls: a
# 20 us sleep lasts ~55 us here, and a TP 2 step waits at 8 collectives for the slower rank.
_SPIN_S, _OWN_CORE_SPIN_S, _SLEEP_S, _IDLE_SLEEP_S = 30e-6, 2e-3, 20e-6, 500e-6


class CollectiveTimeout(RuntimeError):
    """A shared-memory collective's peers did not answer in time (dead, stuck or out of step)."""


class GroupResync(RuntimeError):
    """A peer asked the group to resynchronise (its step failed): this collective was abandoned."""


def segment_name(group_name: str, rank: int) -> str:
    return f"latentserve-tp-{group_name}-r{rank}"


class ShmGroup:
    """One per rank process. `barrier` is the process group's (used while setting up only)."""

    def __init__(self, rank: int, world_size: int, group_name: str, barrier, deadline_s: float = 60.0,
                 slot_bytes: int = SLOT_BYTES, own_core: bool = False):
        self.rank, self.world_size = rank, world_size
        self.slot_bytes = slot_bytes
        self.deadline_s = deadline_s
        self.spin_s = _OWN_CORE_SPIN_S if own_core else _SPIN_S
        self._n = 0
        self._gen = 0  # resync generation this rank has completed
        self._lock = threading.Lock()
        size = self.nbytes = _HEADER + 2 * slot_bytes
        own = Segment(segment_name(group_name, rank), size, create=True)
        self._segments = [own]
        atexit.register(self.close)
        barrier()
        segs = [own if p == rank else Segment(segment_name(group_name, p), size, create=False)
                for p in range(world_size)]
        self._segments = segs
        barrier()
        own.unlink()  # every rank mapped it: a rank killed without atexit leaks nothing
        self._counters = [np.frombuffer(s.mm, dtype=np.int64, count=4) for s in segs]
        self._slots = [[np.frombuffer(s.mm, dtype=np.uint8, count=slot_bytes, offset=_HEADER + k * slot_bytes)
                        for k in range(2)] for s in segs]
        # The same bytes as torch tensors, [slot][rank]: collectives read and write them in place.
        self._tslots = [[torch.from_numpy(self._slots[p][k]) for p in range(world_size)] for k in range(2)]
        self._views: dict[tuple, list[torch.Tensor]] = {}  # (slot, dtype, shape) -> every rank's view
        self._closed = False

    # ---- the protocol ------------------------------------------------------------------
    def _wait(self, counter: int, ranks, n: int, what: str, deadline_s: float | None) -> None:
        """Until counter (READY or DONE) >= n on each of `ranks`."""
        views = [self._counters[p] for p in ranks]
        if all(v[counter] >= n for v in views):
            return
        start = time.perf_counter()
        while not all(v[counter] >= n for v in views):
            now = time.perf_counter()
            if now - start > self.spin_s:
                tight_sleep_slack()
                time.sleep(_IDLE_SLEEP_S if deadline_s is None and now - start > 0.01 else _SLEEP_S)
            elif self.spin_s > _SPIN_S:
                os.sched_yield()
            if self.resync_requested():
                raise GroupResync(f"TP rank {self.rank}: shared-memory {what} (op {n}) abandoned: a peer "
                                  f"asked the group to resynchronise (its step failed)")
            if deadline_s is not None and now - start > deadline_s:
                raise CollectiveTimeout(f"TP rank {self.rank}: shared-memory {what} (op {n}) got no answer "
                                        f"within {deadline_s:g}s (a peer died, is stuck, or the ranks ran "
                                        f"different collectives)")

    def _begin(self, what: str) -> tuple[int, int]:
        self._n += 1
        n = self._n
        self._wait(DONE, range(self.world_size), n - 2, what, self.deadline_s)
        return n, n % 2

    def _publish_ready(self, n: int) -> None:
        self._counters[self.rank][READY] = n

    def _publish_done(self, n: int) -> None:
        self._counters[self.rank][DONE] = n

    def _exchange(self, payload: np.ndarray, what: str) -> list[np.ndarray]:
        """Every rank's bytes (same length everywhere), rank order; payload is uint8 [nbytes]."""
        nbytes = payload.nbytes
        out = [np.empty(nbytes, dtype=np.uint8) for _ in range(self.world_size)]
        for lo in range(0, max(nbytes, 1), self.slot_bytes):
            hi = min(nbytes, lo + self.slot_bytes)
            n, s = self._begin(what)
            self._slots[self.rank][s][: hi - lo] = payload[lo:hi]
            self._publish_ready(n)
            self._wait(READY, range(self.world_size), n, what, self.deadline_s)
            for p in range(self.world_size):
                out[p][lo:hi] = self._slots[p][s][: hi - lo]
            self._publish_done(n)
        return out

    # ---- collectives --------------------------------------------------------------------
    def _in_place(self, t: torch.Tensor, what: str, read):
        """One op whose payload fits a slot: t into this rank's slot, then `read(parts)` on every
        rank's slot viewed as t (before this rank reports done, so no peer overwrites them)."""
        n, s = self._begin(what)
        key = (s, t.dtype, t.shape)
        slots = self._views.get(key)
        if slots is None:
            if len(self._views) > 64:
                self._views.clear()
            nbytes = t.numel() * t.element_size()
            slots = self._views[key] = [v[:nbytes].view(t.dtype).view(t.shape) for v in self._tslots[s]]
        slots[self.rank].copy_(t)
        self._publish_ready(n)
        self._wait(READY, range(self.world_size), n, what, self.deadline_s)
        out = read(slots)
        self._publish_done(n)
        return out

    def _fits(self, t: torch.Tensor) -> bool:
        return t.is_contiguous() and t.numel() * t.element_size() <= self.slot_bytes

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum into t (CPU), in rank order and fp32: every rank gets the same bits."""
        if self._fits(t):
            def total(parts: list[torch.Tensor]) -> None:
                if t.dtype == torch.float32:  # ((p0 + p1) + p2) ..., straight into t
                    torch.add(parts[0], parts[1], out=t)
                    for part in parts[2:]:
                        t.add_(part)
                    return
                acc = parts[0].float()
                for part in parts[1:]:
                    acc += part
                t.copy_(acc)

            with self._lock:
                self._in_place(t, "all_reduce", total)
            return t
        with self._lock:  # larger than a slot: in pieces
            parts = self._exchange(_bytes(t), "all_reduce")
        acc = torch.zeros(t.shape, dtype=torch.float32)
        for part in parts:
            acc += torch.from_numpy(part).view(t.dtype).view(t.shape)
        t.copy_(acc)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        t = t.contiguous()
        if self._fits(t):
            with self._lock:
                return self._in_place(t, "all_gather", lambda parts: torch.cat(parts, dim=dim))
        with self._lock:
            parts = self._exchange(_bytes(t), "all_gather")
        return torch.cat([torch.from_numpy(p).view(t.dtype).view(t.shape) for p in parts], dim=dim)

    def broadcast_ints(self, values: np.ndarray | None, src: int = 0, wait_forever: bool = False) -> np.ndarray:
        """int64 values from `src` to every rank; others pass None. With wait_forever the
        receivers wait without a deadline (a follower idle until the next plan)."""
        with self._lock:
            n0 = self._n
            if self.rank == src:
                data = np.concatenate([np.array([values.size], dtype=np.int64), values.astype(np.int64)])
                raw = data.view(np.uint8)
                for lo in range(0, raw.nbytes, self.slot_bytes):
                    n, s = self._begin("broadcast")
                    piece = raw[lo:lo + self.slot_bytes]
                    self._slots[src][s][: piece.nbytes] = piece
                    self._publish_ready(n)
                    self._publish_done(n)
                return values
            chunks, total = [], None
            while total is None or sum(c.nbytes for c in chunks) < total:
                n, s = self._begin("broadcast")
                idle = wait_forever and n == n0 + 1
                self._wait(READY, (src,), n, "broadcast", None if idle else self.deadline_s)
                if total is None:
                    total = 8 * (1 + int(self._slots[src][s][:8].view(np.int64)[0]))
                take = min(self.slot_bytes, total - sum(c.nbytes for c in chunks))
                chunks.append(self._slots[src][s][:take].copy())
                self._publish_ready(n)
                self._publish_done(n)
            return np.concatenate(chunks).view(np.int64)[1:]

    def barrier(self) -> None:
        with self._lock:
            self._exchange(np.zeros(0, dtype=np.uint8), "barrier")

    # ---- recovery -------------------------------------------------------------------------
    def resync_requested(self) -> bool:
        """A peer announced a resync generation this rank has not joined yet."""
        return any(int(c[GEN]) > self._gen for c in self._counters)

    def resync(self, deadline_s: float | None) -> int:
        """Realign every rank's op counter after a failed step; every rank calls it (a peer's
        request ends pending waits with GroupResync). deadline_s None: wait for the peers as long
        as it takes. Returns the agreed op number."""
        with self._lock:
            g = self._gen + 1
            own = self._counters[self.rank]
            own[GEN] = g  # peers' waits see it and leave their collectives
            self._wait_all(GEN, g, "resync (join)", deadline_s)
            # Nobody publishes ready/done while in resync: every rank reads the same counters.
            base = max(int(v) for c in self._counters for v in (c[READY], c[DONE])) + 2
            own[GEN_ACK] = g
            self._wait_all(GEN_ACK, g, "resync (agree)", deadline_s)
            # Above every counter published before: a stale ready or done never passes for a new op.
            own[DONE] = base
            own[READY] = base
            self._n = base
            self._gen = g
            return base

    def _wait_all(self, field: int, g: int, what: str, deadline_s: float | None) -> None:
        start = time.perf_counter()
        while True:
            late = [p for p, c in enumerate(self._counters) if int(c[field]) < g]
            if not late:
                return
            waited = time.perf_counter() - start
            if deadline_s is not None and waited > deadline_s:
                raise CollectiveTimeout(f"TP rank {self.rank}: shared-memory {what}, generation {g}: ranks "
                                        f"{late} did not join within {deadline_s:g}s (dead or stuck)")
            tight_sleep_slack()
            time.sleep(_IDLE_SLEEP_S if waited > 0.01 else _SLEEP_S)

    def close(self) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._counters, self._slots, self._tslots, self._views = [], [], [], {}
        for seg in self._segments:
            seg.close()
        atexit.unregister(self.close)


def _bytes(t: torch.Tensor) -> np.ndarray:
    t = t.contiguous()
    return t.view(torch.uint8).view(-1).numpy() if t.numel() else np.zeros(0, dtype=np.uint8)
