"""The MoE entry kernel with the experts chosen in it (service/model/moe_entry.py, SELECT),
compiled for sm_90 without a GPU (Triton's CUDA backend and bundled ptxas): each router program
releases its logits with a CTA barrier and then one acq_rel atomic at GPU scope (a release by one
thread covers the others' stores only after the barrier; Triton 3.6 puts one there for the
atomic's shared-memory broadcast too, so the check is that one separates them, whoever put it),
and the choice costs the kernel no
registers: 220 a thread with it or without at small's batch 1 launch, so 2 programs an SM either way.

Needs a Triton install (`pip install triton==3.6.0`, no GPU needed), which the CPU venv and CI
lack: it skips there; GPU machines have one."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia.compiler")

from bench.triton_ir import compile_entry, registers  # noqa: E402


def _instructions(ptx: str) -> list[str]:
    return [line.strip() for line in ptx.splitlines() if line.strip() and not line.strip().startswith((".loc", "//"))]


def test_logits_are_released_after_a_barrier_by_one_acq_rel_atomic():
    ptx = compile_entry(True).asm["ptx"]
    ins = _instructions(ptx)
    arrivals = [i for i, line in enumerate(ins) if "atom.global.gpu.acq_rel.add" in line]
    assert len(arrivals) == 1, arrivals
    last_store = max(i for i, line in enumerate(ins[:arrivals[0]]) if line.startswith(("st.global", "@")) and "st.global" in line)
    assert any(line.startswith("bar.sync") for line in ins[last_store:arrivals[0]])
    assert "atom.global.gpu.acq_rel" not in _instructions(compile_entry(False).asm["ptx"])


def test_the_choice_costs_no_registers():
    with_choice, without = registers(compile_entry(True).asm["ptx"]), registers(compile_entry(False).asm["ptx"])
    assert with_choice[1] == without[1] == 0 and with_choice[0] <= without[0], (with_choice, without)
