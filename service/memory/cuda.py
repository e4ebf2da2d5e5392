"""CUDA backend of the memory pool: cuMem virtual memory through `cuda.bindings.driver`.

Each chunk reserves a VA range once and maps physical allocations into it. Release unmaps and
releases the physical memory but keeps the VA reserved; wake creates one fresh allocation and
maps it at the same VA, so tensors, peer tables and captured CUDA graphs stay valid.
`cuda.bindings` is imported on first use: CPU machines do not have it.
"""

from __future__ import annotations

import torch


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:  # cuda-python < 12.6 spelled it this way
        from cuda import cuda as driver
    return driver


class CudaDriverError(RuntimeError):
    pass


def _check(call: str, result):
    drv = _driver()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != drv.CUresult.CUDA_SUCCESS:
        _, msg = drv.cuGetErrorString(err)
        raise CudaDriverError(f"{call} failed: {err!r} {msg.decode() if msg else ''}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


class _DeviceSpan:
    """`__cuda_array_interface__` over raw VA; the tensor made from it holds this object, which
    holds the region, so the reservation outlives every tensor carved from it."""

    def __init__(self, region: CudaRegion, nbytes: int):
        self.region = region
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (region.address, False),
            "strides": None, "version": 3,
        }


class CudaRegion:
    def __init__(self, address: int, capacity: int, shareable: bool):
        self.address = address
        self.capacity = capacity
        self.shareable = shareable
        self.mapped = 0
        self.handles: list[tuple[int, int, object]] = []  # (offset, size, handle)
        self.base: torch.Tensor | None = None


class CudaBackend:
    def __init__(self, device: torch.device):
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        self.index = self.device.index
        with torch.cuda.device(self.index):
            torch.empty(1, device=self.device)  # make torch create the primary context first
        drv = _driver()
        _check("cuInit", drv.cuInit(0))
        self.granularity = int(_check("cuMemGetAllocationGranularity", drv.cuMemGetAllocationGranularity(
            self._prop(shareable=False), drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
        self.stream = torch.cuda.Stream(device=self.device)

    def _prop(self, shareable: bool):
        drv = _driver()
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = self.index
        if shareable:
            prop.requestedHandleTypes = drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        return prop

    def _map(self, region: CudaRegion, offset: int, size: int, handle=None) -> None:
        drv = _driver()
        if handle is None:
            handle = _check("cuMemCreate", drv.cuMemCreate(size, self._prop(region.shareable), 0))
        try:
            _check("cuMemMap", drv.cuMemMap(region.address + offset, size, 0, handle, 0))
        except CudaDriverError:
            drv.cuMemRelease(handle)
            raise
        access = drv.CUmemAccessDesc()
        access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        access.location.id = self.index
        access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        _check("cuMemSetAccess", drv.cuMemSetAccess(region.address + offset, size, [access], 1))
        region.handles.append((offset, size, handle))

    def reserve(self, capacity: int, shareable: bool = False) -> CudaRegion:
        drv = _driver()
        with torch.cuda.device(self.index):
            ptr = _check("cuMemAddressReserve", drv.cuMemAddressReserve(capacity, self.granularity, 0, 0))
        return CudaRegion(int(ptr), capacity, shareable)

    def commit(self, region: CudaRegion, nbytes: int) -> None:
        """Grow the physical backing to cover [0, nbytes); growth is a new allocation after the last."""
        if nbytes <= region.mapped:
            return
        with torch.cuda.device(self.index):
            self._map(region, region.mapped, nbytes - region.mapped)
        region.mapped = nbytes
        if region.base is None:  # torch asks the driver which device owns the pointer: map first
            region.base = self._wrap(region, region.capacity)

    def _wrap(self, region: CudaRegion, nbytes: int) -> torch.Tensor:
        base = torch.as_tensor(_DeviceSpan(region, nbytes))  # no device=: never a copy
        if base.device != self.device or base.data_ptr() != region.address:
            raise CudaDriverError(f"cuMem wrap: torch sees {base.device} at {base.data_ptr():#x}, "
                                  f"expected {self.device} at {region.address:#x}")
        return base

    def view(self, region: CudaRegion, offset: int, nbytes: int) -> torch.Tensor:
        return region.base[offset:offset + nbytes]

    def release(self, region: CudaRegion) -> None:
        drv = _driver()
        with torch.cuda.device(self.index):
            for offset, size, handle in region.handles:
                _check("cuMemUnmap", drv.cuMemUnmap(region.address + offset, size))
                _check("cuMemRelease", drv.cuMemRelease(handle))
        region.handles = []

    def remap(self, region: CudaRegion) -> None:
        # One allocation for the whole mapped range, wherever the chunk grew in steps.
        if region.mapped and not region.handles:
            with torch.cuda.device(self.index):
                self._map(region, 0, region.mapped)

    def backup(self, region: CudaRegion, nbytes: int) -> torch.Tensor:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        with torch.cuda.stream(self.stream):
            host.copy_(region.base[:nbytes], non_blocking=True)
        return host

    def restore(self, region: CudaRegion, backup: torch.Tensor) -> None:
        with torch.cuda.stream(self.stream):
            region.base[:backup.numel()].copy_(backup, non_blocking=True)

    def poison(self, region: CudaRegion, nbytes: int) -> None:
        with torch.cuda.stream(self.stream):
            region.base[:nbytes].fill_(0xFF)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def export_fd(self, region: CudaRegion) -> int:
        if not region.shareable or len(region.handles) != 1:
            raise ValueError("only comm chunks (one allocation, never released) are exportable")
        drv = _driver()
        fd = _check("cuMemExportToShareableHandle", drv.cuMemExportToShareableHandle(
            region.handles[0][2], drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0))
        return int(fd)

    def import_fd(self, fd: int, nbytes: int) -> torch.Tensor:
        """Map a peer's exported comm allocation into this process (uint8 tensor of nbytes).

        The caller may close fd afterwards; the mapping lives as long as the tensor's region."""
        drv = _driver()
        size = -(-nbytes // self.granularity) * self.granularity
        with torch.cuda.device(self.index):
            handle = _check("cuMemImportFromShareableHandle", drv.cuMemImportFromShareableHandle(
                fd, drv.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR))
            region = self.reserve(size)
            self._map(region, 0, size, handle)
        region.mapped = size
        region.base = self._wrap(region, size)
        return region.base[:nbytes]

    def free_memory(self) -> int:
        with torch.cuda.device(self.index):
            free, _total = _check("cuMemGetInfo", _driver().cuMemGetInfo())
        return int(free)

    def close(self, region: CudaRegion) -> None:
        """Unmap and free the VA: only when no tensor of this region will be used again."""
        self.release(region)
        with torch.cuda.device(self.index):
            _check("cuMemAddressFree", _driver().cuMemAddressFree(region.address, region.capacity))
        region.mapped = 0
