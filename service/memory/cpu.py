"""CPU backend of the memory pool: each chunk is one anonymous private mmap.

Release is `madvise(MADV_DONTNEED)`: the address range stays mapped (tensors keep their
data_ptr), the pages go back to the kernel (RSS drops) and read as zeros until written again,
which is what "fresh memory at the same address" means here. Comm chunks are memfd-backed
shared mappings so that another process can map them through `export_fd`.
"""

from __future__ import annotations

import mmap
import os

import torch

PAGE = mmap.PAGESIZE
# Linux >= 5.14: fault a whole range in with one call; page-by-page faults halve copy speed.
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _populate(mm: mmap.mmap, nbytes: int) -> None:
    try:
        mm.madvise(MADV_POPULATE_WRITE, 0, nbytes)
    except OSError:  # older kernel: the copy faults the pages in instead
        pass


class CpuRegion:
    def __init__(self, capacity: int, shareable: bool):
        self.capacity = capacity
        self.mapped = 0
        self.fd = -1
        if shareable:
            self.fd = os.memfd_create("latentserve-comm", os.MFD_CLOEXEC)
            os.ftruncate(self.fd, capacity)
            self.mm = mmap.mmap(self.fd, capacity, flags=mmap.MAP_SHARED)
        else:
            self.mm = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE)
        # frombuffer keeps the mmap exported (alive) for as long as any view exists.
        self.base = torch.frombuffer(self.mm, dtype=torch.uint8)

    @property
    def address(self) -> int:
        return self.base.data_ptr()


class CpuBackend:
    device = torch.device("cpu")
    granularity = PAGE

    def reserve(self, capacity: int, shareable: bool = False) -> CpuRegion:
        return CpuRegion(capacity, shareable)

    def commit(self, region: CpuRegion, nbytes: int) -> None:
        # Pages fault in on first write; only the bookkeeping grows.
        region.mapped = max(region.mapped, nbytes)

    def view(self, region: CpuRegion, offset: int, nbytes: int) -> torch.Tensor:
        return region.base[offset:offset + nbytes]

    def release(self, region: CpuRegion) -> None:
        if region.mapped:
            region.mm.madvise(mmap.MADV_DONTNEED, 0, region.mapped)

    def remap(self, region: CpuRegion) -> None:
        pass  # the next touch maps a zeroed page at the same address

    def backup(self, region: CpuRegion, nbytes: int) -> torch.Tensor:
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
        _populate(mm, nbytes)
        host = torch.frombuffer(mm, dtype=torch.uint8)
        host.copy_(region.base[:nbytes])
        return host

    def restore(self, region: CpuRegion, backup: torch.Tensor) -> None:
        _populate(region.mm, backup.numel())
        region.base[:backup.numel()].copy_(backup)

    def poison(self, region: CpuRegion, nbytes: int) -> None:
        region.base[:nbytes].fill_(0xFF)

    def synchronize(self) -> None:
        pass

    def export_fd(self, region: CpuRegion) -> int:
        if region.fd < 0:
            raise ValueError("only comm chunks are shareable")
        return os.dup(region.fd)

    def import_fd(self, fd: int, nbytes: int) -> torch.Tensor:
        """Map a peer's exported comm buffer into this process (uint8 tensor of nbytes)."""
        return torch.frombuffer(mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED), dtype=torch.uint8)

    def free_memory(self) -> int:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
        return 0

    def close(self, region: CpuRegion) -> None:
        # The mmap cannot be unmapped while tensors view it; dropping the pages is what matters.
        self.release(region)
        if region.fd >= 0:
            os.close(region.fd)
            region.fd = -1


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE
