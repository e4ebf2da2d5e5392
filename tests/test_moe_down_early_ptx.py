"""The experts' early down kernel (service/model/moe_down_early.py) issues its weight slab before
the PDL wait, checked without a GPU: compiled for sm_90 (Triton's CUDA backend and bundled ptxas),
only the reads of `h` (the gate/up kernel's output, one span a load) may follow the wait, and the
slab must fit in registers without spilling (at the 1024-wide shard, 161 registers a thread at
4 warps: 3 programs an SM).

Needs a Triton install (`pip install triton==3.6.0`, no GPU needed), which the CPU venv and CI
lack: it skips there; GPU machines have one."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia.compiler")

from bench.triton_ir import compile_down_early, loads_before_wait, registers  # noqa: E402


@pytest.mark.parametrize("block_n,warps", [(16, 4), (32, 8)])
@pytest.mark.parametrize("shard,h_loads", [(768, 2), (384, 2), (1024, 1)])
def test_only_h_is_read_after_the_pdl_wait(block_n, warps, shard, h_loads):
    ptx = compile_down_early(block_n, warps, shard).asm["ptx"]
    early, total = loads_before_wait(ptx)
    assert total - early == h_loads, (early, total)
    regs, spilled = registers(ptx)
    assert spilled == 0 and regs < 255, (regs, spilled)  # 72 / 102 at 768 wide, 161 / 188 at 1024
