"""The hand-written CUDA C kernels (service/model/*.cu, as nvrtc.py compiles them) load
nothing through the read-only path. `ld.global.nc` is valid only for data no kernel writes during
the kernel's lifetime, and under PDL a kernel starts while the one before it still writes its
inputs (runs 120-121: the engine's decode graphs with the MLA kernel differed from the eager step
while it read q that way); ptxas also moved such loads below `griddepcontrol.wait` in the GEMV's
first version, where coherent ones stay put. And a kernel that takes dynamic shared memory exports
how much (nvrtc.smem_bytes), so its launch cannot fall out of step with its layout. Needs
cuda.bindings' NVRTC (the GPU machine's, or PyPI's cuda-bindings and nvidia-cuda-nvrtc), no GPU."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings")

from service.model import nvrtc  # noqa: E402

# No `gpu` mark: NVRTC compiles without a device, so this runs wherever cuda.bindings imports.
pytestmark = pytest.mark.timeout(120)
SOURCES = sorted(Path(nvrtc.__file__).parent.glob("*.cu"))


def test_every_kernel_file_is_checked():
    assert {p.name for p in SOURCES} >= {"mla_small.cu", "gemv_small.cu"}


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_no_read_only_path_loads(source):
    ptx = nvrtc.compile_source(source, "compute_90").decode(errors="replace")
    assert ".entry" in ptx and "griddepcontrol.wait" in ptx
    assert "ld.global.nc" not in ptx


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_dynamic_shared_memory_is_exported(source):
    """Each entry of a file that declares `extern __shared__` exports its size, within an sm_90
    SM's 227 KB; read from the cubin as nvrtc.function and the launch read it."""
    ptx = nvrtc.compile_source(source, "compute_90").decode(errors="replace")
    cubin = nvrtc.compile_source(source, "sm_90")
    for name in re.findall(r"\.entry (\w+)\(", ptx):
        smem = nvrtc.elf_int(cubin, f"{name}_smem")
        if ".extern .shared" in ptx:
            assert smem is not None and 0 < smem <= 227 * 1024, (name, smem)
        else:
            assert smem is None, name
