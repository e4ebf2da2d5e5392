"""service/model/fusion.py's contract, without a GPU: a compiler failure falls back to the eager
function for good; an error of the computation itself propagates and keeps the compiled path."""

import pytest
import torch
import torch._dynamo.exc as dynamo_exc

from service.model import fusion


class FakeCuda:
    is_cuda = True


def test_compiler_failure_falls_back_to_eager_once(monkeypatch):
    calls = {"compiled": 0}

    def fake_compile(fn, **kw):
        def run(*args):
            calls["compiled"] += 1
            raise dynamo_exc.FailOnRecompileLimitHit("limit")
        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    f = fusion.fused(lambda x, y: ("eager", y))
    assert f(FakeCuda(), 1) == ("eager", 1)
    assert f(FakeCuda(), 2) == ("eager", 2)
    assert calls["compiled"] == 1, "a broken compiler must not be retried on every call"


def test_runtime_error_propagates_and_compiled_path_stays(monkeypatch):
    state = {"fail": True, "compiled": 0}

    def fake_compile(fn, **kw):
        def run(*args):
            state["compiled"] += 1
            if state["fail"]:
                raise RuntimeError("CUDA out of memory")
            return "compiled"
        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    f = fusion.fused(lambda x: "eager")
    with pytest.raises(RuntimeError, match="out of memory"):
        f(FakeCuda())
    state["fail"] = False
    assert f(FakeCuda()) == "compiled" and state["compiled"] == 2


def test_cpu_and_switch_off_stay_eager(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: pytest.fail("compiled on CPU"))
    f = fusion.fused(lambda x: "eager")
    assert f(torch.zeros(1)) == "eager"
    monkeypatch.setenv("LATENTSERVE_COMPILE", "0")
    assert f(FakeCuda()) == "eager"
