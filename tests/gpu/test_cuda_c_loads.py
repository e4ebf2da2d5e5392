"""The hand-written CUDA C kernels (service/model/*.cu, as nvrtc.py compiles them) load
nothing through the read-only path. `ld.global.nc` is valid only for data no kernel writes during
the kernel's lifetime, and under PDL a kernel starts while the one before it still writes its
inputs (runs 120-121: the engine's decode graphs with the MLA kernel differed from the eager step
while it read q that way); ptxas also moved such loads below `griddepcontrol.wait` in the GEMV's
first version, where coherent ones stay put. Needs cuda.bindings' NVRTC (the GPU machine's), no GPU."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("cuda.bindings")

from service.model import nvrtc  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(120)]
SOURCES = sorted(Path(nvrtc.__file__).parent.glob("*.cu"))


def test_every_kernel_file_is_checked():
    assert {p.name for p in SOURCES} >= {"mla_small.cu", "gemv_small.cu"}


@pytest.mark.parametrize("source", SOURCES, ids=lambda p: p.name)
def test_no_read_only_path_loads(source):
    ptx = nvrtc.compile_source(source, "compute_90").decode(errors="replace")
    assert ".entry" in ptx and "griddepcontrol.wait" in ptx
    assert "ld.global.nc" not in ptx
