"""Pieces of the HTTP service that need no ranks: request parsing, the lifecycle state names, and
the admin API switched off when no key is configured."""

from __future__ import annotations

import asyncio
import gc
import time
import types
from concurrent.futures import Future

import pytest
from fastapi.testclient import TestClient

from service.engine_config import EngineConfig
from service.lifecycle import EngineStateError, LifecycleState
from service.server.app import create_app
from service.server.controller import Controller
from service.server.protocol import APIError, ChatCompletionRequest, CompletionRequest


def test_prompt_shapes():
    assert CompletionRequest(prompt="hi").prompts() == [("hi", None)]
    assert CompletionRequest(prompt=["a", "b"]).prompts() == [("a", None), ("b", None)]
    assert CompletionRequest(prompt=[1, 2]).prompts() == [(None, [1, 2])]
    assert CompletionRequest(prompt=[[1], [2, 3]]).prompts() == [(None, [1]), (None, [2, 3])]
    for bad in ([], [[1], []]):
        with pytest.raises(APIError) as e:
            CompletionRequest(prompt=bad).prompts()
        assert e.value.status == 422


def test_sampling_params_mapping_and_range_errors():
    p = CompletionRequest(prompt="x", n=2, temperature=0, max_tokens=5, stop="!", seed=3, logprobs=1,
                          top_k=4, ignore_eos=True).sampling_params()
    assert (p.n, p.temperature, p.max_tokens, p.stop_list, p.seed, p.logprobs, p.top_k, p.ignore_eos) == \
        (2, 0.0, 5, ["!"], 3, 1, 4, True)
    chat = ChatCompletionRequest(messages=[{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                      {"type": "text", "text": "b"}]}],
                                 logprobs=True, top_logprobs=3, max_completion_tokens=7)
    assert chat.template_messages() == [{"role": "user", "content": "ab"}]
    assert (chat.sampling_params().logprobs, chat.sampling_params().max_tokens) == (3, 7)
    for kw in (dict(top_p=0.0), dict(max_tokens=0), dict(logprobs=99), dict(echo=True)):
        with pytest.raises(APIError) as e:
            CompletionRequest(prompt="x", **kw).sampling_params()
        assert e.value.status == 422
    with pytest.raises(APIError, match="top_logprobs needs logprobs"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], top_logprobs=2).sampling_params()


def test_lifecycle_state_names_in_precedence_order():
    s = LifecycleState(asleep=[set(), set()])
    assert s.name == "running"
    s.user_paused = True
    assert s.name == "paused"
    s.weights_valid = False
    assert s.name == "weights-invalid"
    s.sleep_level, s.asleep = 2, [{"weights"}, {"weights", "kv_cache"}]
    assert s.name == "sleeping" and s.tags_asleep == ["kv_cache", "weights"]
    s.failed = "rank 1 died"
    assert s.name == "failed"


def test_admin_api_is_off_without_a_key():
    # The admin check runs before any route touches the ranks, so no ranks are started here.
    ctl = Controller(EngineConfig(model="tiny").resolve(), model_name="tiny")
    client = TestClient(create_app(ctl, admin_key=None))
    for method, path in [("POST", "/sleep?level=1"), ("POST", "/wake_up"), ("GET", "/is_sleeping"),
                         ("POST", "/update_weights"), ("GET", "/v1/status"), ("POST", "/restart"),
                         ("POST", "/collective_rpc")]:
        r = client.request(method, path, headers={"Authorization": "Bearer anything"})
        assert r.status_code == 403, path
        assert "admin API is off" in r.json()["error"]["message"] and "--admin-key" in r.json()["error"]["message"]


def test_request_racing_a_sleep_is_refused_with_the_state_not_a_500():
    """check_generation passed, then a sleep paused the engine before add_request reached rank 0:
    the engine's refusal is the model's state (503, retry), like a refusal before admission."""

    class Rank0Refuses:
        def submit(self, rank, method, *args):
            fut = Future()
            fut.set_exception(EngineStateError("the engine is paused: resume it (or wake it up) before generating"))
            return fut

        def is_dead(self, e):
            return False

    ctl = Controller(EngineConfig(model="tiny").resolve(), model_name="tiny")
    ctl.coordinator = types.SimpleNamespace(executor=Rank0Refuses())
    with pytest.raises(APIError) as e:
        asyncio.run(ctl.rank0("add_request", "r", "x", None, None))
    assert (e.value.status, e.value.code, e.value.retry) == (503, "model_state", True)
    assert "paused" in e.value.message


def test_a_request_past_its_deadline_gets_a_504_after_what_had_arrived():
    """One timer a route puts the 504 into its queue at the deadline: outputs queued before it are
    read first, and a released route's timer is cancelled (nothing is put into a forgotten queue)."""
    from service.server.route import Route

    ctl = Controller(EngineConfig(model="tiny").resolve(), model_name="tiny", request_timeout_s=0.05)

    async def main():
        loop = asyncio.get_running_loop()
        route = Route(asyncio.Queue(), loop)
        deadline = time.monotonic() + 0.05
        route.queue.put_nowait("first")
        assert await ctl.next_output(route, deadline) == "first"
        with pytest.raises(APIError) as e:
            await asyncio.wait_for(ctl.next_output(route, deadline), 5.0)
        assert e.value.status == 504 and "0.05s" in e.value.message
        other = Route(asyncio.Queue(), loop)
        waiting = asyncio.create_task(ctl.next_output(other, time.monotonic() + 0.05))
        await asyncio.sleep(0)
        ctl.release(other)
        waiting.cancel()
        await asyncio.sleep(0.1)
        assert other.deadline.cancelled() and other.queue.empty()

    asyncio.run(main())


# The body `vllm bench serve --backend openai` sends to /v1/completions
# (vllm/benchmarks/lib/endpoint_request_func.py, async_request_openai_completions, vLLM 0.32)
# with --temperature 0 and the random dataset's ignore_eos.
VLLM_BENCH_SERVE_BODY = {"model": "tiny", "prompt": "t5 t6 t7", "repetition_penalty": 1.0, "max_tokens": 8,
                         "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
                         "ignore_eos": True, "temperature": 0.0}


def test_vllm_bench_serve_body_is_accepted_and_repetition_penalty_is_checked():
    req = CompletionRequest(**VLLM_BENCH_SERVE_BODY)  # was a 422: repetition_penalty is not an OpenAI field
    p = req.sampling_params()
    assert (p.max_tokens, p.temperature, p.ignore_eos, p.logprobs, req.stream, req.include_usage) == \
        (8, 0.0, True, None, True, True)
    assert CompletionRequest(prompt="x", repetition_penalty=None).sampling_params().max_tokens == 16
    for value in (1.2, 0.5):  # a penalty we would silently not apply is refused instead
        with pytest.raises(APIError) as e:
            CompletionRequest(prompt="x", repetition_penalty=value).sampling_params()
        assert (e.value.status, e.value.param, e.value.code) == (422, "repetition_penalty", "unsupported_parameter")
    with pytest.raises(APIError, match="repetition_penalty"):
        ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], repetition_penalty=2.0).sampling_params()


def test_the_controller_freezes_the_gc_while_it_serves_and_unfreezes_on_close():
    """Startup's ~230K objects stay out of the cyclic GC's full collections while serving (each
    stalled every stream ~100 ms on a 2-core CPU; bench/RESULTS.md, 2026-12-05), and an
    in-process controller gives them back when it closes."""
    ctl = Controller(EngineConfig(model="tiny").resolve(), model_name="tiny")  # no ranks: its loops idle

    async def serve_then_close():
        await ctl.start_background()
        frozen = gc.get_freeze_count()
        await ctl.close()
        return frozen

    gc.unfreeze()
    assert asyncio.run(serve_then_close()) > 0
    assert gc.get_freeze_count() == 0
