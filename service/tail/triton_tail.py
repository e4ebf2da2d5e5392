"""GPU backend of the fused tail: Triton kernels over cuMem comm regions mapped by peers.

Each rank's comm region (protocol.MailboxLayout) is a cuMem allocation with a POSIX-FD handle;
peers import the FD and map it in their own address space, and every kernel reads those
addresses from the `peer_ptrs` state table. Stores are unicast (no NVLink multicast).

Two ways to run:
- one process per rank (`TritonTailCollective(..., barrier=tp.barrier)`): FDs travel over
  abstract Unix sockets (SCM_RIGHTS), named from the group name;
- `VirtualTailGroup`: all ranks as objects of one process on one GPU (tests, bench). Calls run
  step by step across the ranks on one stream, so every wait depends only on launched work.
Under TRITON_INTERPRET=1 (no GPU) the kernels run on host memory, without the PTX.
"""

from __future__ import annotations

import os

import torch
import triton

from .base import TailTimeout
from .comm_memory import alloc_comm, exchange_fds, resolve_device
from .protocol import EPOCH as _EPOCH
from .protocol import (
    EXCHANGES,
    GATHER,
    INITIAL_FLAGS,
    PTR_COLS,
    ROUTED,
    SHARED,
    MailboxLayout,
    alloc_state,
    bits_dtype,
    check_inputs,
    describe_arrival,
    describe_stale,
    resolve_deadline,
    sentinel,
    timeout_error,
)
from .triton_kernels import (
    CODE_STALE,
    CODE_TAGS,
    ERR_BUF,
    ERR_CODE,
    ERR_EPOCH,
    ERR_EX,
    ERR_FIELDS,
    ERR_MASK,
    ERR_RANK,
    ERR_TAGS,
    advance_kernel,
    clear_kernel,
    collect_kernel,
    push_kernel,
)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_PUSH_BLOCK = 1024
_CLEAR_BLOCK = 1024
_CLEAR_CHUNKS = 4


class TritonTailCollective:
    """Fused latent-MoE tail on a GPU (one instance per rank)."""

    def __init__(self, rank: int, world_size: int, *, max_tokens: int, latent_dim: int, hidden_dim: int,
                 dtype: torch.dtype, state_alloc, group_name: str = "tail", deadline_s: float = 10.0,
                 barrier=None, device: torch.device | str | None = None, regions: list | None = None):
        """`regions`: every rank's comm region as mapped here (VirtualTailGroup); None maps them
        over Unix sockets, one process per rank, synchronised by `barrier`."""
        self.rank, self.world_size, self.max_tokens, self.dtype = rank, world_size, max_tokens, dtype
        self.device = resolve_device(device)
        esize = torch.empty((), dtype=dtype).element_size()
        self.layout = lay = MailboxLayout(world_size, max_tokens, latent_dim, hidden_dim, esize)
        self.deadline_s = resolve_deadline(deadline_s)
        self._bits = 8 * esize
        self._use_ptx = not INTERPRET
        # The interpreter has no clock in kernels: bound its spins by count instead.
        self._max_spins = 2**31 - 1 if self._use_ptx else max(50, int(self.deadline_s * 100))
        self._deadline_ns = int(self.deadline_s * 1e9)
        self.routed_flags, self.shared_flags, self.peer_ptrs = alloc_state(state_alloc, world_size, self.device)
        for t in (self.routed_flags, self.shared_flags, self.peer_ptrs):
            if t.device != self.device:
                raise ValueError(f"state_alloc gave a tensor on {t.device}, expected {self.device}")
        self.err = torch.zeros(ERR_FIELDS, dtype=torch.int32, device=self.device)
        self._owned = []
        if regions is None:
            own = alloc_comm(lay.total_bytes, self.device)
            self._fill_empty(own)
            regions = exchange_fds(own, group_name, rank, world_size, barrier)
            self._owned = regions
        rows = [lay.ptr_row(r.address) for r in regions]
        self._own_region = regions[rank]
        self._rows = torch.tensor(rows, dtype=torch.int64)  # the table as built: rearm() restores it
        self.peer_ptrs.copy_(self._rows)

    def _fill_empty(self, region) -> None:
        lay, view = self.layout, region.bytes()
        view.view(bits_dtype(self.dtype)).fill_(sentinel(self.dtype))
        for ex in range(len(EXCHANGES)):
            view[lay.tags_offset(ex):lay.tags_offset(ex) + lay.tags_bytes()].zero_()

    # ---- diagnostics and the negative-control hook ----------------------------
    def epoch(self) -> int:
        return int(self.routed_flags[_EPOCH])

    def state(self) -> dict:
        r, s = self.routed_flags.tolist(), self.shared_flags.tolist()
        return {"routed": {"cur": r[0], "dirty": r[1], "epoch": r[3]},
                "shared": {"cur": s[0], "dirty": s[1], "epoch": s[3]}}

    def zero_flags(self) -> None:
        self.routed_flags.zero_()
        self.shared_flags.zero_()

    def rearm(self) -> None:
        """Re-arm this rank's side after a failed exchange: its own comm region refilled (sentinel
        payloads, EMPTY tags), flags initial, the peer table as built, the error words cleared.
        Only while no peer writes, and followed by a barrier before the next exchange."""
        self._fill_empty(self._own_region)
        init = torch.tensor(INITIAL_FLAGS, dtype=torch.int32, device=self.device)
        self.routed_flags.copy_(init)
        self.shared_flags.copy_(init)
        self.peer_ptrs.copy_(self._rows)
        self.err.zero_()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # ---- the collective -------------------------------------------------------
    def fused_tail(self, routed_partial, shared_partial, norm_weight, up_weight, eps, *, check: bool = True):
        """check=False leaves out the host read of the error words (CUDA-graph capture); call
        `check()` after the replays."""
        m = check_inputs(self.layout, routed_partial, shared_partial, up_weight)
        self.push_inputs(routed_partial, shared_partial)
        latent, shared = self.reduce(m, norm_weight, eps)
        self.project(latent, shared, up_weight)
        out = self.gather(m)
        self.finish(m)
        # While a CUDA graph captures, the host cannot read err: DecodeGraphs.run checks after replay.
        if check and not (self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            self.check()
        return out

    # The steps, each a launch sequence on the current stream (VirtualTailGroup interleaves them).
    def _common(self):
        lay = self.layout
        return dict(TP=self.world_size, PTR_COLS=PTR_COLS, BITS=self._bits, USE_PTX=self._use_ptx), lay

    def push_inputs(self, routed: torch.Tensor, shared: torch.Tensor) -> None:
        c, lay = self._common()
        m, bdt = routed.shape[0], bits_dtype(self.dtype)
        rb = routed.to(self.dtype).contiguous().view(bdt)
        sb = shared.to(self.dtype).contiguous().view(bdt)
        for ex, src, col_step in ((ROUTED, rb, 0), (SHARED, sb, lay.shard)):
            flags = self.routed_flags if ex == ROUTED else self.shared_flags
            push_kernel[(self.world_size,)](
                src, src.stride(0), src, 0, self.peer_ptrs, flags, self.err, self.rank, m, col_step,
                self._deadline_ns, self._max_spins, EX=ex, WIDTH=lay.width(ex), SLOT=lay.slot_elems(ex),
                HAS_ADD=False, BLOCK=_PUSH_BLOCK, **c)

    def _collect(self, ex, out, norm_weight, eps, mode, m):
        c, lay = self._common()
        width = lay.width(ex)
        block = triton.next_power_of_2(width)
        flags = self.routed_flags if ex == ROUTED else self.shared_flags
        collect_kernel[(m,)](
            out, out.stride(0), norm_weight if norm_weight is not None else out, self.peer_ptrs, flags,
            self.err, self.rank, float(eps), self._deadline_ns, self._max_spins, EX=ex, WIDTH=width,
            SLOT=lay.slot_elems(ex), TP_P2=max(2, triton.next_power_of_2(self.world_size)), MODE=mode,
            HAS_NORM=norm_weight is not None, BLOCK_W=block, num_warps=4 if block <= 2048 else 8, **c)

    def reduce(self, m: int, norm_weight, eps: float):
        lay = self.layout
        latent = torch.empty(m, lay.latent_dim, dtype=self.dtype, device=self.device)
        shared = torch.empty(m, lay.shard, dtype=torch.float32, device=self.device)
        self._collect(ROUTED, latent, norm_weight, eps, 0, m)
        self._collect(SHARED, shared, None, 0.0, 1, m)
        return latent, shared

    def project(self, latent: torch.Tensor, shared: torch.Tensor, up_weight: torch.Tensor) -> None:
        """out_shard = latent . W_up[shard]^T + shared_shard, pushed to every peer (all-gather)."""
        c, lay = self._common()
        hs, r = lay.shard, self.rank
        y = torch.matmul(latent, up_weight[r * hs:(r + 1) * hs].to(self.dtype).t())
        push_kernel[(self.world_size,)](
            y, y.stride(0), shared, shared.stride(0), self.peer_ptrs, self.shared_flags, self.err, self.rank,
            latent.shape[0], 0, self._deadline_ns, self._max_spins, EX=GATHER, WIDTH=hs,
            SLOT=lay.slot_elems(GATHER), HAS_ADD=True, BLOCK=_PUSH_BLOCK, **c)

    def gather(self, m: int) -> torch.Tensor:
        out = torch.empty(m, self.layout.hidden_dim, dtype=self.dtype, device=self.device)
        self._collect(GATHER, out, None, 0.0, 2, m)
        return out

    def finish(self, m: int) -> None:
        c, lay = self._common()
        clear_kernel[(len(EXCHANGES), self.world_size, _CLEAR_CHUNKS)](
            self.peer_ptrs, self.routed_flags, self.shared_flags, self.rank, R_SLOT=lay.slot_elems(ROUTED),
            S_SLOT=lay.slot_elems(SHARED), TP=self.world_size, PTR_COLS=PTR_COLS, BITS=self._bits,
            ESIZE=lay.elem_size, BLOCK=_CLEAR_BLOCK)
        es = lay.elem_size
        advance_kernel[(1,)](self.routed_flags, self.shared_flags, m * lay.latent_dim * es, m * lay.shard * es)

    def check(self) -> None:
        """Turn a kernel's recorded timeout into TailTimeout (synchronises with the stream)."""
        e = self.err.tolist()
        if e[ERR_CODE]:
            raise self._error(e)

    def _error(self, e: list[int]) -> TailTimeout:
        peers = [p for p in range(self.world_size) if e[ERR_MASK] >> p & 1]
        found = e[ERR_TAGS:ERR_TAGS + self.world_size]
        if e[ERR_CODE] == CODE_STALE:
            what = "; ".join(describe_stale(p, e[ERR_RANK], found[p]) for p in peers)
        elif e[ERR_CODE] == CODE_TAGS:
            what = describe_arrival(found, e[ERR_EPOCH], [])
        else:
            what = describe_arrival([e[ERR_EPOCH]] * self.world_size, e[ERR_EPOCH], peers)
        return timeout_error(e[ERR_RANK], e[ERR_EX], e[ERR_BUF], e[ERR_EPOCH], self.deadline_s, what)

    def close(self) -> None:
        for region in self._owned:
            region.close()
        self._owned = []


# ---- virtual ranks ----------------------------------------------------------------------------

class VirtualTailGroup:
    """TP ranks as objects of one process sharing one device (tests and bench).

    Each rank maps its peers' regions at addresses of its own (FD export + import, as separate
    processes would), and has its own flags and peer table."""

    def __init__(self, world_size: int, *, max_tokens: int, latent_dim: int, hidden_dim: int,
                 dtype: torch.dtype, deadline_s: float = 10.0, device: torch.device | str | None = None):
        self.device = resolve_device(device)
        esize = torch.empty((), dtype=dtype).element_size()
        lay = MailboxLayout(world_size, max_tokens, latent_dim, hidden_dim, esize)
        own = [alloc_comm(lay.total_bytes, self.device) for _ in range(world_size)]
        self.regions = list(own)
        self.ranks = []
        for r in range(world_size):
            mapped = [own[p] if p == r else own[p].alias() for p in range(world_size)]
            self.regions += [m for p, m in enumerate(mapped) if m is not own[p]]

            def state_alloc(name, shape, dt):
                return torch.zeros(shape, dtype=dt, device=self.device)

            coll = TritonTailCollective(r, world_size, max_tokens=max_tokens, latent_dim=latent_dim,
                                        hidden_dim=hidden_dim, dtype=dtype, state_alloc=state_alloc,
                                        deadline_s=deadline_s, device=self.device, regions=mapped)
            coll._fill_empty(own[r])
            self.ranks.append(coll)

    def fused_tail(self, routed: list[torch.Tensor], shared: list[torch.Tensor], norm_weight, up_weight,
                   eps: float, check: bool = True) -> list[torch.Tensor]:
        """check=False leaves out the host read of the error words (CUDA-graph capture); call
        `check()` after the replays."""
        ranks = self.ranks
        m = check_inputs(ranks[0].layout, routed[0], shared[0], up_weight)
        for c, x, s in zip(ranks, routed, shared):
            c.push_inputs(x, s)
        reduced = [c.reduce(m, norm_weight, eps) for c in ranks]
        for c, (latent, sh) in zip(ranks, reduced):
            c.project(latent, sh, up_weight)
        outs = [c.gather(m) for c in ranks]
        for c in ranks:
            c.finish(m)
        if check:
            self.check()
        return outs

    def check(self) -> None:
        for c in self.ranks:
            c.check()

    def zero_flags(self) -> None:
        for c in self.ranks:
            c.zero_flags()

    def rearm(self) -> None:
        for c in self.ranks:
            c.rearm()

    def close(self) -> None:
        for region in self.regions:
            region.close()
        self.regions = []
