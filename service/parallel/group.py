"""Tensor-parallel group: the collectives the model and the engine need.

Ranks of one node exchange CPU tensors and step plans through shared memory (`ShmGroup`, after
`use_shared_memory`); across nodes, and for device tensors, torch.distributed does it (gloo
or NCCL). At world size 1 every collective is the identity, so the model code never branches.
"""

from __future__ import annotations

import datetime
import os

import numpy as np
import torch
import torch.distributed as dist

# Followers wait in a broadcast for the next step plan for as long as the engine is idle.
_IDLE_TIMEOUT = datetime.timedelta(days=7)


class TPGroup:
    def __init__(self, rank: int = 0, world_size: int = 1, group=None):
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.shm = None  # ShmGroup when the ranks share a node
        # Device collectives of one node's ranks (service/tail/device_comm.py), set by the worker:
        # CUDA tensors up to their capacity (decode steps, also inside CUDA graphs) go there.
        self.device_comm = None

    def use_shared_memory(self, group_name: str, deadline_s: float = 60.0) -> None:
        """Move this node's collectives to shared memory (every rank calls it, same name)."""
        if self.world_size > 1 and self.shm is None:
            from .shm_group import ShmGroup

            self.shm = ShmGroup(self.rank, self.world_size, group_name, self.barrier, deadline_s=deadline_s,
                                own_core=pinned_cores() > 0)

    def _on_shm(self, t: torch.Tensor) -> bool:
        return self.shm is not None and t.device.type == "cpu"

    @classmethod
    def single(cls) -> TPGroup:
        return cls(0, 1, None)

    @classmethod
    def init(cls, rank: int, world_size: int, init_method: str, backend: str = "gloo") -> TPGroup:
        if world_size == 1:
            return cls.single()
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=_IDLE_TIMEOUT)
        return cls(rank, world_size, dist.group.WORLD)

    # ---- tensor collectives --------------------------------------------------
    def _on_device_comm(self, t: torch.Tensor) -> bool:
        return self.device_comm is not None and t.is_cuda and self.device_comm.fits(t)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """The sum over ranks; use the result (the device path returns a new tensor)."""
        if self._on_device_comm(t):
            return self.device_comm.all_reduce(t)
        if self._on_shm(t):
            return self.shm.all_reduce(t)
        if self.world_size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        if self.world_size == 1:
            return t
        if self._on_shm(t):
            return self.shm.all_gather(t, dim)
        if dim in (-1, t.dim() - 1) and self._on_device_comm(t):
            return self.device_comm.all_gather(t)
        parts = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(parts, t.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self.world_size > 1:
            dist.broadcast(t, src=src, group=self.group)
        return t

    def broadcast_object(self, obj=None, src: int = 0):
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def broadcast_ints(self, values: np.ndarray | None, src: int = 0, wait_forever: bool = False) -> np.ndarray:
        """An int64 array from `src` (the others pass None): the step plans' binary form. With
        wait_forever the receivers wait as long as it takes (a follower idle between plans)."""
        if self.world_size == 1:
            return values
        if self.shm is not None:
            return self.shm.broadcast_ints(values, src, wait_forever)
        return self.broadcast_object(values, src)  # across nodes: rare, and NCCL needs no special case

    def barrier(self) -> None:
        if self.shm is not None:
            self.shm.barrier()
        elif self.world_size > 1:
            dist.barrier(group=self.group)

    # ---- sharding helpers ----------------------------------------------------
    def shard(self, n: int) -> tuple[int, int]:
        """(start, size) of this rank's slice of a dimension of length n."""
        size = n // self.world_size
        return self.rank * size, size

    def destroy(self) -> None:
        if self.device_comm is not None:
            self.device_comm.close()
            self.device_comm = None
        if self.shm is not None:
            self.shm.close()
            self.shm = None
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()


_pinned_cores = 0  # cores set_cpu_threads pinned this rank process to (0: not pinned)


def pinned_cores() -> int:
    """Cores this rank process was pinned to by `set_cpu_threads` (0: none, the OS places it)."""
    return _pinned_cores


def set_cpu_threads(world_size: int, rank: int | None = None) -> int:
    """Give each rank an equal share of the CPU so TP ranks do not oversubscribe it, and, when
    every rank can have cores of its own, pin rank `rank` to its share (as vLLM's CPU backend
    binds its OpenMP threads): its threads then never migrate onto a peer's core mid-collective.
    LATENTSERVE_CPU_BIND=0 leaves placement to the OS.

    Torch threads: one core per rank is left out of the count for what is not the forward (the
    engine loop's Python, Ray, the HTTP server, other tenants), as vLLM's CPU backend reserves
    one core per rank for its scheduler: an OpenMP team that spans every core waits at each
    parallel region for whichever member lost its core to them (TP 1 on 2 cores, batch 16:
    2 threads ran 3x slower than 1, bench/RESULTS.md 2026-12-03). LATENTSERVE_THREADS_PER_RANK
    overrides it."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    world = max(world_size, 1)
    n = max(1, (len(cores) - world) // world)
    n = int(os.environ.get("LATENTSERVE_THREADS_PER_RANK", n))
    bind = os.environ.get("LATENTSERVE_CPU_BIND", "1") != "0"
    if bind and rank is not None and 1 < world_size <= len(cores) and hasattr(os, "sched_setaffinity"):
        share = len(cores) // world_size
        mine = cores[rank * share:(rank + 1) * share]
        # Every thread of the process (a Ray actor runs this on one of several); threads
        # started later inherit it from their creator.
        for tid in os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]:
            try:
                os.sched_setaffinity(int(tid), mine)
            except (ProcessLookupError, PermissionError):  # a thread that just ended
                pass
        global _pinned_cores
        _pinned_cores = len(mine)
    torch.set_num_threads(n)
    return n
