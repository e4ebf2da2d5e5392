"""The hand-written CUDA C kernels' build and launch (mla_small.cu, gemv_small.cu).

Each .cu file is compiled by NVRTC at first use on each device through `cuda.bindings` (no
toolkit at install time, none of CUDA's headers: the files declare what they use, and share
this folder's headers, mma_bf16.cuh and gemv_tile.cuh, handed to NVRTC with each file) and its kernels are
launched with `cuLaunchKernelEx` on torch's current stream, so CUDA graphs capture them like any
other kernel, with programmatic dependent launch where the Triton kernels have it (pdl.py). A
machine without `cuda.bindings` keeps the Triton kernels; each caller's `KernelGuard` turns its
kernel off for the process when a build or first launch fails.
"""

from __future__ import annotations

import ctypes
import functools
import struct
from pathlib import Path

import torch

from . import pdl


@functools.cache
def available() -> bool:
    """cuda.bindings' driver and NVRTC modules import."""
    try:
        from cuda.bindings import driver, nvrtc  # noqa: F401
    except ImportError:
        return False
    return True


def runs_on(t: torch.Tensor) -> bool:
    """The CUDA C kernels can run on t's device: a GPU of sm_90 or later (PDL's griddepcontrol)
    with cuda.bindings importable."""
    return t.is_cuda and available() and torch.cuda.get_device_capability(t.device)[0] >= 9


def aligned(t: torch.Tensor, *strides: int) -> bool:
    """t's data 16-byte aligned and these strides (in 2-byte elements) whole 16-byte steps: the
    kernels' 16-byte loads."""
    return t.data_ptr() % 16 == 0 and all(s % 8 == 0 for s in strides)


def check(err, what: str) -> None:
    if int(err) != 0:
        raise RuntimeError(f"{what} failed: {err!r}")


def compile_source(source: Path, arch: str) -> bytes:
    """`source` (with this folder's headers) compiled by NVRTC for `arch`: a cubin for "sm_90",
    PTX text for a virtual architecture ("compute_90")."""
    from cuda.bindings import nvrtc

    headers = sorted(source.parent.glob("*.cuh"))  # what the kernels `#include "..."`
    err, prog = nvrtc.nvrtcCreateProgram(source.read_bytes(), source.name.encode(), len(headers),
                                         [h.read_bytes() for h in headers], [h.name.encode() for h in headers])
    check(err, "nvrtcCreateProgram")
    opts = [f"--gpu-architecture={arch}".encode(), b"-default-device", b"--std=c++17"]
    (err,) = nvrtc.nvrtcCompileProgram(prog, len(opts), opts)
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = b" " * size
        nvrtc.nvrtcGetProgramLog(prog, log)
        raise RuntimeError(f"NVRTC could not compile {source.name}: {log.decode(errors='replace')}")
    ptx = arch.startswith("compute_")
    err, size = (nvrtc.nvrtcGetPTXSize if ptx else nvrtc.nvrtcGetCUBINSize)(prog)
    check(err, "nvrtcGetPTXSize" if ptx else "nvrtcGetCUBINSize")
    out = b" " * size
    check((nvrtc.nvrtcGetPTX if ptx else nvrtc.nvrtcGetCUBIN)(prog, out)[0], "nvrtcGetPTX/CUBIN")
    return out


@functools.cache
def _cubin(source: Path, device_index: int) -> bytes:
    major, minor = torch.cuda.get_device_capability(device_index)
    return compile_source(source, f"sm_{major}{minor}")


def elf_int(image: bytes, symbol: str) -> int | None:
    """The initial value of a 32-bit `symbol` in an ELF image (a cubin's `extern "C" __device__
    const int`), read on the host: a copy from the device would break a CUDA graph capture that
    happens to launch the kernel first. None if the image has no such symbol."""
    shoff, = struct.unpack_from("<Q", image, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", image, 0x3A)
    # Section headers: (type, offset, size, link) of each.
    sections = [struct.unpack_from("<4xI16xQQI", image, shoff + i * shentsize) for i in range(shnum)]
    for kind, offset, size, link in sections:
        if kind != 2:  # SHT_SYMTAB; its link is its string table
            continue
        strtab = sections[link][1]
        for at in range(offset, offset + size, 24):
            name_at, shndx, value = struct.unpack_from("<I2xHQ", image, at)
            end = image.index(b"\0", strtab + name_at)
            if image[strtab + name_at:end] == symbol.encode() and 0 < shndx < shnum:
                return struct.unpack_from("<i", image, sections[shndx][1] + value)[0]
    return None


@functools.cache
def smem_bytes(source: Path, name: str, device_index: int) -> int:
    """The dynamic shared memory kernel `name` takes, as its file exports it (`extern "C"
    __device__ const int <name>_smem`); 0 for a kernel that exports none."""
    return elf_int(_cubin(source, device_index), f"{name}_smem") or 0


@functools.cache
def _module(source: Path, device_index: int):
    """The compiled module of `source` on this device (kept alive by this cache)."""
    from cuda.bindings import driver

    cubin = _cubin(source, device_index)
    torch.cuda.init()
    with torch.cuda.device(device_index):
        torch.cuda.current_stream()  # torch's primary context current on this thread
        image = ctypes.create_string_buffer(cubin, len(cubin))
        err, module = driver.cuModuleLoadData(ctypes.addressof(image))
        check(err, "cuModuleLoadData")
    return module


@functools.cache
def function(source: Path, name: str, device_index: int):
    """Kernel `name` of `source` on this device, allowed the dynamic shared memory it exports
    (`smem_bytes`)."""
    from cuda.bindings import driver

    module = _module(source, device_index)
    smem = smem_bytes(source, name, device_index)
    with torch.cuda.device(device_index):
        err, func = driver.cuModuleGetFunction(module, name.encode())
        check(err, "cuModuleGetFunction")
        if smem > 48 * 1024:
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            check(driver.cuFuncSetAttribute(func, attr, smem)[0], "cuFuncSetAttribute")
    return func


def ptr(t: torch.Tensor) -> ctypes.c_void_p:
    return ctypes.c_void_p(t.data_ptr())


def launch(func, grid: tuple[int, int, int], threads: int, smem_bytes: int, device: torch.device,
           args: list) -> bool:
    """func<<<grid, threads, smem_bytes>>> on torch's current stream of `device`, with PDL where it is
    on; args are ctypes values in the kernel's parameter order. True once launched (a `KernelGuard`
    reads None as a failure)."""
    from cuda.bindings import driver

    params = (ctypes.c_void_p * len(args))(*[ctypes.addressof(v) for v in args])
    cfg = driver.CUlaunchConfig()
    cfg.gridDimX, cfg.gridDimY, cfg.gridDimZ = grid
    cfg.blockDimX, cfg.blockDimY, cfg.blockDimZ = threads, 1, 1
    cfg.sharedMemBytes = smem_bytes
    cfg.hStream = driver.CUstream(torch.cuda.current_stream(device).cuda_stream)
    if pdl.enabled(device):
        attr = driver.CUlaunchAttribute()
        attr.id = driver.CUlaunchAttributeID.CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
        attr.value.programmaticStreamSerializationAllowed = 1
        cfg.attrs, cfg.numAttrs = [attr], 1
    (err,) = driver.cuLaunchKernelEx(cfg, func, ctypes.addressof(params), 0)
    check(err, "cuLaunchKernelEx")
    return True
