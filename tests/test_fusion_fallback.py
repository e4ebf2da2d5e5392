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


class Doubler(torch.nn.Module):
    def forward(self, x):
        return ("eager", x * 2)


def test_compiled_forward_falls_back_once_and_errors_propagate(monkeypatch):
    state = {"compiled": 0, "mode": "compiler"}

    def fake_compile(fn, **kw):
        assert kw.get("dynamic") is True

        def run(module, *args):
            state["compiled"] += 1
            if state["mode"] == "compiler":
                raise dynamo_exc.FailOnRecompileLimitHit("limit")
            if state["mode"] == "runtime":
                raise RuntimeError("CUDA out of memory")
            return ("compiled", fn(module, *args)[1])
        return run

    monkeypatch.setattr(torch, "compile", fake_compile)
    broken = fusion.CompiledForward("layer", dynamic=True)
    assert broken(Doubler(), 2) == ("eager", 4) and broken(Doubler(), 3) == ("eager", 6)
    assert state["compiled"] == 1 and broken.broken and "limit" in broken.error

    state.update(compiled=0, mode="runtime")
    ok = fusion.CompiledForward("layer", dynamic=True)
    with pytest.raises(RuntimeError, match="out of memory"):
        ok(Doubler(), 1)
    state["mode"] = "fine"
    assert ok(Doubler(), 1) == ("compiled", 2) and not ok.broken and ok.calls == 1


def test_compiled_calls_route_module_calls_inside_the_block_only(monkeypatch):
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: lambda m, *a: ("compiled", fn(m, *a)[1]))
    mods = [Doubler(), Doubler()]
    compiled = fusion.CompiledForward("layer")
    with fusion.compiled_calls(mods, compiled):
        assert [m(3) for m in mods] == [("compiled", 6)] * 2
    assert [m(3) for m in mods] == [("eager", 6)] * 2
    with pytest.raises(ValueError), fusion.compiled_calls(mods, compiled):
        raise ValueError("restored on errors too")
    assert mods[0]._compiled_call_impl is None and mods[0](1) == ("eager", 2)


def test_compile_modes(monkeypatch):
    monkeypatch.delenv("LATENTSERVE_COMPILE", raising=False)
    assert fusion.compile_enabled() and fusion.layers_enabled()  # whole layers by default
    monkeypatch.setenv("LATENTSERVE_COMPILE", "layers")
    assert fusion.compile_enabled() and fusion.layers_enabled()
    monkeypatch.setenv("LATENTSERVE_COMPILE", "chains")
    assert fusion.compile_enabled() and not fusion.layers_enabled()
    monkeypatch.setenv("LATENTSERVE_COMPILE", "0")
    assert not fusion.compile_enabled() and not fusion.layers_enabled()
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: pytest.fail("compiled with LATENTSERVE_COMPILE=0"))
    assert fusion.CompiledForward("layer")(Doubler(), 1) == ("eager", 2)


def test_a_capture_the_compiled_layers_break_is_retried_uncompiled(monkeypatch):
    from types import SimpleNamespace

    from service.model import cuda_graph

    built = []

    class FakeGraphs:
        def __init__(self, *args, compile_layers=None, scratch=None):
            built.append(compile_layers)
            if compile_layers:
                raise RuntimeError("operation not permitted when stream is capturing")
            self.sizes = args[-1]

        def stats(self):
            return {"compiled_layers": None}

    monkeypatch.setattr(cuda_graph, "DecodeGraphs", FakeGraphs)
    monkeypatch.setattr(cuda_graph, "unsupported_reason", lambda model, kv, max_batch=None: None)
    monkeypatch.setenv("LATENTSERVE_COMPILE", "layers")
    config = SimpleNamespace(enforce_eager=False, device="cuda", cuda_graph_batch_sizes=[1, 8], max_num_seqs=8,
                             block_size=16, max_model_len=64, kv_blocks=lambda: 32)
    graphs = cuda_graph.for_worker(None, [], config)
    assert isinstance(graphs, FakeGraphs) and built == [True, False]
    built.clear()
    monkeypatch.setenv("LATENTSERVE_COMPILE", "chains")
    assert isinstance(cuda_graph.for_worker(None, [], config), FakeGraphs) and built == [False]
