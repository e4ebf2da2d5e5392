"""The fused tail's Lamport protocol: mailbox layout, flags, sentinels, deadlines (DESIGN §1).

Shared by the CPU (shared memory) and GPU (Triton) backends, so both lay out a rank's `comm`
region the same way and fail the same way when the persistent state is lost.

A rank's comm region holds, per exchange (routed AR, shared RS, gather AG), a mailbox of
NBUF buffers x tp sender slots x (max_tokens x width) elements followed by an int32 tag per
(buffer, slot). Flags and the peer table are not in comm: they are named state of the
weights pool, which is the point - lose them and the ranks disagree about the buffers.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .base import TailTimeout

ROUTED, SHARED, GATHER = 0, 1, 2
EXCHANGES = ("routed", "shared", "gather")
NBUF = 3  # triple buffering: receive into cur, clear dirty, the third is ready for the next call
EMPTY = 0  # tag of a slot nobody has written since it was cleared

# Flag array fields; shared_flags govern both the shared (RS) and gather (AG) mailboxes.
CUR, DIRTY, BTC, EPOCH = 0, 1, 2, 3
NFLAGS = 4
INITIAL_FLAGS = (0, 2, 0, 1)  # epoch starts at 1 so a written tag never equals EMPTY

# peer_ptrs[p] = (routed payload, routed tags, shared payload, shared tags, gather payload,
# gather tags) of peer p's mailboxes, as mapped in this process.
PTR_COLS = 2 * len(EXCHANGES)

STATE_NAMES = ("tail.routed_flags", "tail.shared_flags", "tail.peer_ptrs")

_ALIGN = 256  # keeps every array 16-byte vector and cache-line aligned on CPU and GPU
DEADLINE_ENV = "LATENTSERVE_TAIL_DEADLINE_S"

# Negative zero as the integer a payload element reads as; -0.0 never travels (writers send +0.0).
_SENTINEL = {torch.float32: (torch.int32, -(2**31)), torch.bfloat16: (torch.int16, -(2**15))}


class TailStateError(RuntimeError):
    """The persistent tail state is unusable (e.g. a peer table entry maps no mailbox)."""


def bits_dtype(dtype: torch.dtype) -> torch.dtype:
    """Integer dtype of the same width, used for sentinel scans and sentinel-safe copies."""
    return _sentinel_entry(dtype)[0]


def sentinel(dtype: torch.dtype) -> int:
    """The sentinel (-0.0) as a signed integer of `bits_dtype(dtype)`."""
    return _sentinel_entry(dtype)[1]


def _sentinel_entry(dtype: torch.dtype) -> tuple[torch.dtype, int]:
    try:
        return _SENTINEL[dtype]
    except KeyError:
        raise ValueError(f"fused tail supports float32 and bfloat16 payloads, not {dtype}") from None


def resolve_deadline(deadline_s: float) -> float:
    env = os.environ.get(DEADLINE_ENV)
    value = float(env) if env else float(deadline_s)
    if value <= 0:
        raise ValueError(f"tail deadline must be positive, got {value}")
    return value


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass(frozen=True)
class MailboxLayout:
    """Byte layout of one rank's comm region; identical on every rank."""

    world_size: int
    max_tokens: int
    latent_dim: int
    hidden_dim: int
    elem_size: int

    def __post_init__(self):
        if self.world_size < 2:
            raise ValueError("the fused tail needs TP >= 2")
        if self.hidden_dim % self.world_size:
            raise ValueError(f"hidden_dim {self.hidden_dim} is not divisible by TP {self.world_size}")
        if self.max_tokens < 1:
            raise ValueError("max_tokens must be >= 1")

    @property
    def shard(self) -> int:
        return self.hidden_dim // self.world_size

    def width(self, ex: int) -> int:
        return self.latent_dim if ex == ROUTED else self.shard

    def slot_elems(self, ex: int) -> int:
        return self.max_tokens * self.width(ex)

    def payload_bytes(self, ex: int) -> int:
        return NBUF * self.world_size * self.slot_elems(ex) * self.elem_size

    def tags_bytes(self) -> int:
        return NBUF * self.world_size * 4

    def payload_offset(self, ex: int) -> int:
        off = 0
        for e in range(ex):
            off += _align(self.payload_bytes(e)) + _align(self.tags_bytes())
        return off

    def tags_offset(self, ex: int) -> int:
        return self.payload_offset(ex) + _align(self.payload_bytes(ex))

    @property
    def total_bytes(self) -> int:
        return self.payload_offset(len(EXCHANGES))

    def ptr_row(self, base: int) -> list[int]:
        """The peer_ptrs row of a comm region mapped at `base`."""
        row = []
        for ex in range(len(EXCHANGES)):
            row += [base + self.payload_offset(ex), base + self.tags_offset(ex)]
        return row


def alloc_state(state_alloc, world_size: int, device: torch.device | str = "cpu"):
    """Allocate and initialise the named persistent state: (routed_flags, shared_flags, peer_ptrs)."""
    routed = state_alloc("tail.routed_flags", (NFLAGS,), torch.int32)
    shared = state_alloc("tail.shared_flags", (NFLAGS,), torch.int32)
    table = state_alloc("tail.peer_ptrs", (world_size, PTR_COLS), torch.int64)
    for t, shape in ((routed, (NFLAGS,)), (shared, (NFLAGS,)), (table, (world_size, PTR_COLS))):
        if tuple(t.shape) != shape or not t.is_contiguous():
            raise ValueError(f"state_alloc returned {tuple(t.shape)}, expected a contiguous {shape}")
    init = torch.tensor(INITIAL_FLAGS, dtype=torch.int32)
    routed.copy_(init)
    shared.copy_(init)
    return routed, shared, table


def advanced(flags: tuple[int, int, int, int], bytes_written: int) -> tuple[int, int, int, int]:
    """Flags after a completed exchange: the buffer just read becomes the one to clear."""
    cur, _dirty, _btc, epoch = flags
    return (cur + 1) % NBUF, cur, bytes_written, epoch + 1


def clear_elems(btc: int, layout: MailboxLayout, ex: int) -> int:
    """Elements per slot to re-fill with the sentinel; clamped so corrupt flags cannot overrun."""
    n = -(-max(btc, 0) // layout.elem_size)
    return min(n, layout.slot_elems(ex))


def check_inputs(layout: MailboxLayout, routed: torch.Tensor, shared: torch.Tensor,
                 up_weight: torch.Tensor) -> int:
    m = routed.shape[0]
    if routed.dim() != 2 or routed.shape[1] != layout.latent_dim:
        raise ValueError(f"routed_partial must be [M, {layout.latent_dim}], got {tuple(routed.shape)}")
    if tuple(shared.shape) != (m, layout.hidden_dim):
        raise ValueError(f"shared_partial must be [{m}, {layout.hidden_dim}], got {tuple(shared.shape)}")
    if tuple(up_weight.shape) != (layout.hidden_dim, layout.latent_dim):
        raise ValueError(f"up_weight must be [{layout.hidden_dim}, {layout.latent_dim}], "
                         f"got {tuple(up_weight.shape)}")
    if not 1 <= m <= layout.max_tokens:
        raise ValueError(f"fused tail takes 1..{layout.max_tokens} tokens, got {m}")
    return m


def timeout_error(rank: int, ex: int, buf: int, epoch: int, deadline_s: float, what: str) -> TailTimeout:
    return TailTimeout(
        f"fused tail rank {rank}: {EXCHANGES[ex]} exchange, buffer {buf}, epoch {epoch}: {what} "
        f"after {deadline_s:g}s (peers' data never arrived; tail flags lost or out of sync "
        f"between ranks, or a peer died)")


def describe_arrival(tags: list[int], epoch: int, data_missing: list[int]) -> str:
    """Which senders' tags/data are missing from a mailbox buffer, for timeout messages."""
    tag_missing = [(p, t) for p, t in enumerate(tags) if t != epoch]
    parts = []
    if tag_missing:
        parts.append("tags missing from peers " + ", ".join(f"{p} (found {t})" for p, t in tag_missing)
                     + f", expected tag {epoch}")
    if data_missing:
        parts.append(f"data incomplete from peers {data_missing}")
    return "; ".join(parts) or "arrival check never passed"


def describe_stale(peer: int, rank: int, tag: int) -> str:
    return (f"peer {peer}'s slot for rank {rank} still holds tag {tag} (unconsumed data: "
            f"a writer never overwrites it; expected EMPTY={EMPTY})")
