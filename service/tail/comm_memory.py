"""Comm memory of the Triton fused tail: one cuMem allocation per rank with a POSIX-FD handle
(`CudaComm`), or host memory under TRITON_INTERPRET=1 (`HostComm`), and the FD exchange over
abstract Unix sockets (SCM_RIGHTS) that lets each rank map every peer's region.
"""

from __future__ import annotations

import os
import socket
import threading

import torch

from .protocol import TailStateError

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _driver():
    from cuda.bindings import driver
    return driver


def _ok(call: str, result):
    drv = _driver()
    err, *rest = result if isinstance(result, tuple) else (result,)
    if err != drv.CUresult.CUDA_SUCCESS:
        raise TailStateError(f"{call} failed: {err!r}")
    return rest[0] if len(rest) == 1 else (tuple(rest) or None)


class _Span:
    def __init__(self, address: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (address, False),
                                         "strides": None, "version": 3}


class CudaComm:
    """A cuMem allocation mapped in this process; FD-exportable so peers can map it too."""

    def __init__(self, handle, size: int, device: torch.device, owner: bool):
        drv = _driver()
        self.handle, self.size, self.device, self.owner = handle, size, device, owner
        with torch.cuda.device(device):
            ptr = _ok("cuMemAddressReserve", drv.cuMemAddressReserve(size, 0, 0, 0))
            _ok("cuMemMap", drv.cuMemMap(ptr, size, 0, handle, 0))
            access = drv.CUmemAccessDesc()
            access.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            access.location.id = device.index
            access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            _ok("cuMemSetAccess", drv.cuMemSetAccess(ptr, size, [access], 1))
        self._ptr = ptr
        self.address = int(ptr)

    @staticmethod
    def _fd_type():
        return _driver().CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR

    @classmethod
    def create(cls, nbytes: int, device: torch.device) -> CudaComm:
        drv = _driver()
        torch.empty(1, device=device)  # torch makes the primary context current first
        _ok("cuInit", drv.cuInit(0))
        prop = drv.CUmemAllocationProp()
        prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device.index
        prop.requestedHandleTypes = cls._fd_type()
        gran = int(_ok("cuMemGetAllocationGranularity", drv.cuMemGetAllocationGranularity(
            prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM)))
        size = -(-nbytes // gran) * gran
        with torch.cuda.device(device):
            handle = _ok("cuMemCreate", drv.cuMemCreate(size, prop, 0))
        return cls(handle, size, device, owner=True)

    def export_fd(self) -> int:
        return int(_ok("cuMemExportToShareableHandle",
                       _driver().cuMemExportToShareableHandle(self.handle, self._fd_type(), 0)))

    @classmethod
    def import_fd(cls, fd: int, size: int, device: torch.device) -> CudaComm:
        with torch.cuda.device(device):
            handle = _ok("cuMemImportFromShareableHandle",
                         _driver().cuMemImportFromShareableHandle(fd, cls._fd_type()))
        return cls(handle, size, device, owner=False)

    def alias(self) -> CudaComm:
        """A second mapping of this memory at another address, through an exported FD."""
        fd = self.export_fd()
        try:
            return self.import_fd(fd, self.size, self.device)
        finally:
            os.close(fd)

    def bytes(self) -> torch.Tensor:
        return torch.as_tensor(_Span(self.address, self.size), device=self.device)

    def close(self) -> None:
        if self.handle is None:
            return
        drv = _driver()
        torch.cuda.synchronize(self.device)
        drv.cuMemUnmap(self._ptr, self.size)
        drv.cuMemAddressFree(self._ptr, self.size)
        drv.cuMemRelease(self.handle)
        self.handle = None


class HostComm:
    """Host memory standing in for comm under Triton's interpreter (no GPU, no PTX)."""

    def __init__(self, nbytes: int):
        self._t = torch.empty(nbytes, dtype=torch.uint8)
        self.size, self.address = nbytes, self._t.data_ptr()

    def alias(self) -> HostComm:
        return self

    def bytes(self) -> torch.Tensor:
        return self._t

    def close(self) -> None:
        pass


def resolve_device(device) -> torch.device:
    if device is None:
        device = "cpu" if INTERPRET else "cuda"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def alloc_comm(nbytes: int, device: torch.device):
    return HostComm(nbytes) if device.type == "cpu" else CudaComm.create(nbytes, device)


def exchange_fds(own: CudaComm, group_name: str, rank: int, world_size: int, barrier) -> list:
    """Map every peer's comm region: each rank serves an FD of its own on an abstract Unix
    socket; the others fetch it (SCM_RIGHTS), import and map it."""
    def addr(r):
        return f"\0latentserve-tail-{group_name}-r{r}"

    fd = own.export_fd()
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(addr(rank))
    srv.listen(world_size)

    def serve():
        for _ in range(world_size - 1):
            conn, _ = srv.accept()
            with conn:
                socket.send_fds(conn, [b"fd"], [fd])

    server = threading.Thread(target=serve, daemon=True)
    server.start()
    barrier()
    regions = []
    try:
        for p in range(world_size):
            if p == rank:
                regions.append(own)
                continue
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
                c.connect(addr(p))
                _msg, fds, _flags, _addr = socket.recv_fds(c, 16, 1)
            try:
                regions.append(CudaComm.import_fd(fds[0], own.size, own.device))
            finally:
                os.close(fds[0])
        server.join(timeout=60)
    finally:
        srv.close()
        os.close(fd)
    barrier()
    return regions


# ---- one rank ---------------------------------------------------------------------------------
