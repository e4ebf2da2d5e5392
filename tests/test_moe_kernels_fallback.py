"""A MoE kernel whose first call fails (a Triton build or launch error on some GPU) turns the
kernels off for good and hands the step back to the torch path; later errors propagate."""

from __future__ import annotations

import pytest

from service.model import moe_kernels
from service.model.kernel_guard import KernelGuard


@pytest.fixture
def fresh(monkeypatch):
    monkeypatch.setattr(moe_kernels, "GUARD", KernelGuard("moe_kernels"))


def test_first_call_failure_turns_the_kernels_off(fresh):
    def broken(*args):
        raise RuntimeError("PTX assembly failed")

    assert moe_kernels.call(broken, 1) is None
    assert "PTX assembly failed" in moe_kernels.failure()
    assert not moe_kernels.enabled()


def test_errors_after_a_good_first_call_propagate(fresh):
    calls = []

    def op(x):
        calls.append(x)
        if len(calls) > 1:
            raise ValueError("bad input")
        return x * 2

    assert moe_kernels.call(op, 3) == 6
    with pytest.raises(ValueError, match="bad input"):
        moe_kernels.call(op, 4)
    assert moe_kernels.failure() is None and moe_kernels.enabled()


def test_a_later_launch_shape_that_cannot_build_turns_the_kernels_off(fresh):
    """Triton compiles each new launch shape at its first launch; one over the GPU's shared memory
    (run 47: the GEMV at 256 rows) fails after smaller shapes ran. The step falls back to torch."""

    class TritonError(Exception):
        pass

    class OutOfResources(TritonError):  # triton.runtime.errors' class, by name
        pass

    def op(rows):
        if rows > 64:
            raise OutOfResources("out of resource: shared memory, Required: 245760, Hardware limit: 232448")
        return rows

    assert moe_kernels.call(op, 8) == 8
    assert moe_kernels.call(op, 256) is None
    assert "shared memory" in moe_kernels.failure() and not moe_kernels.enabled()


def test_compiled_callers_do_not_guard_on_which_ops_ran(fresh):
    """Decode graphs capture compiled layers after eager calls (lm_head's GEMV) verified an op:
    code traced before that must still match, or the capture recompiles (and on the H200 that
    invalidated it). dynamo's eager backend: guards only, no compiler needed."""
    import torch

    guard = moe_kernels.GUARD

    def layer(x):
        return guard.call(torch.neg, x) + 1

    compiled = torch.compile(layer, backend="eager", dynamic=True)
    x = torch.ones(4)
    assert torch.equal(compiled(x), torch.zeros(4))
    guard.call(torch.neg, x)  # an eager caller verifies the op
    assert str(torch.neg) in guard._verified
    with torch.compiler.set_stance("fail_on_recompile"):
        assert torch.equal(compiled(torch.ones(8)), torch.zeros(8))
