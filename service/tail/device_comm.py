"""Device all-reduce and all-gather between the TP ranks of one node, capturable in CUDA graphs.

torch.distributed cannot serve decode graphs at TP > 1: gloo collectives on CUDA tensors are
host round trips (not capturable), and NCCL refuses two ranks on one GPU. These collectives run
on the fused tail's machinery instead (DESIGN §1), reused, not copied: a `TritonTailCollective`
per payload dtype ("channel") owns a cuMem comm region mapped by every peer, the int64 peer
table and the flags (named pool state: kept across sleep at the same address), and its push /
collect / clear / advance kernels run the Lamport protocol on the channel's routed mailbox.

One-shot: every rank pushes its whole payload into slot `rank` of every peer's mailbox (sentinel
-0.0, tag released last); each rank then sums its mailbox's slots in rank order 0..n-1 in fp32
(all ranks get the same bits), or concatenates them (all-gather along the last dim). Every spin
is bounded by the deadline; a kernel that gives up records why in `err` (one buffer for all
channels, so after one timeout the remaining collectives of a step or graph replay skip their
waits) and the host raises `DeviceCommTimeout` - eagerly right after the op, inside a CUDA graph
after the replay (`check()`, called by DecodeGraphs.run).

Payloads up to `max_tokens` rows of the channel's width (decode steps) take this path; larger
ones (prefill) keep torch.distributed. The ops are torch.library custom ops, so compiled layers
keep them opaque. On by default; LATENTSERVE_CUDA_ALLREDUCE=0 turns them off (see `enabled`).
"""

from __future__ import annotations

import os

import torch
import triton

from .base import TailTimeout
from .protocol import ROUTED
from .triton_kernels import (
    CODE_STALE,
    CODE_TAGS,
    ERR_BUF,
    ERR_CODE,
    ERR_EPOCH,
    ERR_FIELDS,
    ERR_MASK,
    ERR_RANK,
    collect_kernel,
    push_kernel,
)
from .triton_tail import TritonTailCollective

ENV = "LATENTSERVE_CUDA_ALLREDUCE"
_PUSH_BLOCK = 1024
_TILE = 2048  # columns per collect program: a vocab-wide all-gather row spans many programs
_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16"}
_REGISTRY: dict[int, DeviceCollectives] = {}


def enabled() -> bool:
    """On unless LATENTSERVE_CUDA_ALLREDUCE=0. First run on an H200 on 2026-12-03 (two ranks on
    one GPU): bitwise equal to torch's sums and gathers, eagerly and in graphs, a lost peer ends
    in a bounded timeout, and TP 2 decode graphs give TP 1's tokens. Off, TP > 1 decodes eagerly
    through torch.distributed."""
    return os.environ.get(ENV, "1").strip() not in ("", "0")


class DeviceCommTimeout(TailTimeout):
    """A device collective's spin-wait passed its deadline (a TailTimeout: recovery treats it alike)."""


class DeviceCollectives:
    """One per rank. `channels`: a TritonTailCollective per payload dtype whose routed mailbox
    holds `max_tokens` x width elements per sender (`create` builds them; tests pass virtual ones)."""

    def __init__(self, rank: int, world_size: int, channels: dict[torch.dtype, TritonTailCollective]):
        self.rank, self.world_size = rank, world_size
        self.channels = channels
        first = next(iter(channels.values()))
        self.device, self.deadline_s = first.device, first.deadline_s
        self.err = torch.zeros(ERR_FIELDS, dtype=torch.int32, device=self.device)
        for ch in channels.values():
            ch.err = self.err  # one error word per rank: a timeout anywhere stops every later wait
        self.capacity = {dt: ch.layout.slot_elems(ROUTED) for dt, ch in channels.items()}
        self.handle = id(self)
        _REGISTRY[self.handle] = self
        self.calls = 0

    @classmethod
    def create(cls, rank: int, world_size: int, *, max_tokens: int, widths: dict[torch.dtype, int], state_alloc,
               group_name: str, deadline_s: float, barrier, device) -> DeviceCollectives:
        """Per-process ranks: each channel maps its peers' regions over Unix sockets (`barrier`
        synchronises the ranks); its flags and peer table are `state_alloc` state, prefixed."""
        channels = {}
        for dtype, width in widths.items():
            name = f"device_comm.{_NAMES[dtype]}"

            def alloc(n, shape, dt, _prefix=name):
                return state_alloc(f"{_prefix}.{n}", shape, dt)

            # hidden_dim = world_size: the shared/gather mailboxes (unused here) get one column.
            channels[dtype] = TritonTailCollective(
                rank, world_size, max_tokens=max_tokens, latent_dim=width, hidden_dim=world_size, dtype=dtype,
                state_alloc=alloc, group_name=f"{group_name}-dc-{_NAMES[dtype]}", deadline_s=deadline_s,
                barrier=barrier, device=device)
        return cls(rank, world_size, channels)

    # ---- what takes this path ---------------------------------------------------
    def fits(self, t: torch.Tensor) -> bool:
        """Same answer on every rank for the same shape and dtype, so all take the same path."""
        cap = self.capacity.get(t.dtype)
        return cap is not None and t.device == self.device and 0 < t.numel() <= cap and t.dim() >= 1

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """A new tensor: the sum over ranks in rank order (fp32 accumulation)."""
        return torch.ops.latentserve.device_all_reduce(t, self.handle)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """Ranks' tensors concatenated along the last dim."""
        return torch.ops.latentserve.device_all_gather(t, self.handle)

    # ---- the steps (one rank; tests interleave them across virtual ranks) ----------
    def push(self, x2: torch.Tensor) -> None:
        ch = self.channels[x2.dtype]
        c, lay = ch._common()
        m, width = x2.shape
        bits = x2.view(_bits(x2.dtype))
        push_kernel[(self.world_size,)](
            bits, width, bits, 0, ch.peer_ptrs, ch.routed_flags, self.err, self.rank, m, 0,
            ch._deadline_ns, ch._max_spins, EX=ROUTED, WIDTH=width, SLOT=lay.slot_elems(ROUTED),
            HAS_ADD=False, BLOCK=_PUSH_BLOCK, **c)

    def collect(self, x2: torch.Tensor, gather: bool) -> torch.Tensor:
        ch = self.channels[x2.dtype]
        c, lay = ch._common()
        m, width = x2.shape
        # A sum lands in fp32 and torch rounds it (round-to-nearest-even on every backend; the
        # interpreter's implicit store cast truncates); a gather copies the payload's own bits.
        dtype = x2.dtype if gather else torch.float32
        out = torch.empty(m, width * self.world_size if gather else width, dtype=dtype, device=x2.device)
        block = min(triton.next_power_of_2(width), _TILE)
        collect_kernel[(m, triton.cdiv(width, block))](
            out, out.stride(0), out, ch.peer_ptrs, ch.routed_flags, self.err, self.rank, 0.0,
            ch._deadline_ns, ch._max_spins, EX=ROUTED, WIDTH=width, SLOT=lay.slot_elems(ROUTED),
            TP_P2=max(2, triton.next_power_of_2(self.world_size)), MODE=2 if gather else 1, HAS_NORM=False,
            BLOCK_W=block, num_warps=4, **c)
        return out.to(x2.dtype)

    def finish(self, x2: torch.Tensor) -> None:
        """Clear the mailbox used one call ago, advance the flags (bytes to clear: this call's)."""
        ch = self.channels[x2.dtype]
        rows = -(-x2.numel() // ch.layout.latent_dim)  # finish() counts bytes in rows of the channel's width
        ch.finish(rows)

    def run(self, t: torch.Tensor, gather: bool) -> torch.Tensor:
        x2 = t.reshape(-1, t.shape[-1]).contiguous()
        self.push(x2)
        out = self.collect(x2, gather)
        self.finish(x2)
        self.calls += 1
        # While a CUDA graph captures, the host cannot read err: DecodeGraphs.run checks after replay.
        if not (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            self.check()
        return out.view(*t.shape[:-1], out.shape[-1])

    # ---- errors, recovery, state --------------------------------------------------
    def check(self) -> None:
        """Raise DeviceCommTimeout if a kernel gave up (reads err: synchronises with the stream)."""
        e = self.err.tolist()
        if not e[ERR_CODE]:
            return
        peers = [p for p in range(self.world_size) if e[ERR_MASK] >> p & 1]
        what = {CODE_STALE: "its slot in their mailboxes still held unconsumed data",
                CODE_TAGS: "their tags never arrived"}.get(e[ERR_CODE], "their data never arrived")
        raise DeviceCommTimeout(
            f"TP device all-reduce/all-gather rank {e[ERR_RANK]}: buffer {e[ERR_BUF]}, epoch {e[ERR_EPOCH]}: "
            f"peers {peers}: {what} after {self.deadline_s:g}s (a peer died or stalled, or the collective "
            f"flags are out of sync between ranks)")

    def rearm(self) -> None:
        """After a failed step, as TritonTailCollective.rearm (then a barrier before the next op)."""
        for ch in self.channels.values():
            ch.rearm()
        self.err.zero_()

    def epochs(self) -> dict[str, int]:
        return {_NAMES[dt]: ch.epoch() for dt, ch in self.channels.items()}

    def zero_flags(self) -> None:
        """Negative control (tests): lose the flags, as a wake without their backup would."""
        for ch in self.channels.values():
            ch.zero_flags()

    def close(self) -> None:
        _REGISTRY.pop(self.handle, None)
        for ch in self.channels.values():
            ch.close()


def _bits(dtype: torch.dtype) -> torch.dtype:
    return torch.int16 if dtype == torch.bfloat16 else torch.int32


def channel_widths(dtype: torch.dtype, hidden: int, vocab: int, world_size: int) -> dict[torch.dtype, int]:
    """Channels a decode step needs: the model dtype for hidden-wide all-reduces, fp32 for the
    lm_head's vocab-sharded logits (gathered in fp32)."""
    widths = {torch.float32: vocab // world_size}
    if dtype in _NAMES:
        widths[dtype] = max(widths.get(dtype, 0), hidden)
    return widths


# ---- custom ops: compiled layers and CUDA graphs keep these opaque ------------------------------

@torch.library.custom_op("latentserve::device_all_reduce", mutates_args=())
def _all_reduce_op(t: torch.Tensor, handle: int) -> torch.Tensor:
    return _REGISTRY[handle].run(t, gather=False)


@_all_reduce_op.register_fake
def _(t, handle):
    return torch.empty_like(t)


@torch.library.custom_op("latentserve::device_all_gather", mutates_args=())
def _all_gather_op(t: torch.Tensor, handle: int) -> torch.Tensor:
    return _REGISTRY[handle].run(t, gather=True)


@_all_gather_op.register_fake
def _(t, handle):
    n = _REGISTRY[handle].world_size
    return t.new_empty(*t.shape[:-1], t.shape[-1] * n)
