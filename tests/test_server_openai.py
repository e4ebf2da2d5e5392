"""The OpenAI API through the official `openai` client, against one TP-2 server (tiny preset).

This server has an admin key but no sleep mode and no test hooks, so it also shows what the
admin API refuses on such a server.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from service.client import Client, ServiceError

GREEDY = dict(model="tiny", temperature=0.0, extra_body={"ignore_eos": True})


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory()


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def admin(server):
    with Client(server.url, server.admin_key, timeout=120) as c:
        yield c


def ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def test_models_lists_the_served_model(oai):
    models = oai.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].model_extra["weight_version"] == 0


def test_greedy_completion_is_deterministic_with_usage_and_weight_version(oai):
    a = oai.completions.create(prompt="The service answers", max_tokens=8, **GREEDY)
    b = oai.completions.create(prompt="The service answers", max_tokens=8, **GREEDY)
    assert ids(a.choices[0]) == ids(b.choices[0]) and a.choices[0].text == b.choices[0].text
    assert len(ids(a.choices[0])) == 8 and a.choices[0].finish_reason == "length"
    assert a.usage.completion_tokens == 8 and a.usage.prompt_tokens > 0
    assert a.usage.total_tokens == a.usage.prompt_tokens + a.usage.completion_tokens
    assert a.model_extra["weight_version"] == 0


def test_token_id_prompts_with_n_give_ordered_choices(oai):
    r = oai.completions.create(prompt=[[5, 6, 7], [8, 9, 10, 11]], n=2, max_tokens=4, **GREEDY)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    # Greedy: the n samples of one prompt agree; the two prompts are separate requests.
    assert ids(r.choices[0]) == ids(r.choices[1]) and ids(r.choices[2]) == ids(r.choices[3])
    assert r.usage.prompt_tokens == 7 and r.usage.completion_tokens == 16


def test_seed_makes_sampling_reproducible(oai):
    kw = dict(model="tiny", prompt="The service answers", max_tokens=12, temperature=1.0,
              extra_body={"ignore_eos": True})
    a = oai.completions.create(seed=7, **kw)
    b = oai.completions.create(seed=7, **kw)
    c = oai.completions.create(seed=8, **kw)
    assert ids(a.choices[0]) == ids(b.choices[0])
    assert ids(a.choices[0]) != ids(c.choices[0])  # 12 near-uniform draws over 1024 ids


def test_tiny_top_p_keeps_only_the_top_token(oai):
    greedy = oai.completions.create(prompt="The service answers", max_tokens=8, **GREEDY)
    nucleus = oai.completions.create(model="tiny", prompt="The service answers", max_tokens=8, temperature=1.0,
                                     top_p=1e-6, seed=3, extra_body={"ignore_eos": True})
    assert ids(nucleus.choices[0]) == ids(greedy.choices[0])


def test_stop_token_ids_and_stop_strings(oai):
    full = oai.completions.create(prompt="In the morning", max_tokens=16, **GREEDY).choices[0]
    stop_id = ids(full)[3]
    first = ids(full).index(stop_id)
    r = oai.completions.create(model="tiny", prompt="In the morning", max_tokens=16, temperature=0.0,
                               extra_body={"ignore_eos": True, "stop_token_ids": [stop_id]}).choices[0]
    assert r.finish_reason == "stop" and ids(r) == ids(full)[:first + 1]
    text = full.text
    stop = next((text[i:i + 2] for i in range(1, len(text) - 1) if text[i:i + 2].isalpha()), None)
    # Greedy output of fixed dummy weights: deterministic, so a missing candidate is a failure.
    assert stop is not None, f"no two-letter stop string in {text!r}: choose another prompt"
    r = oai.completions.create(prompt="In the morning", max_tokens=16, stop=[stop], **GREEDY).choices[0]
    assert r.finish_reason == "stop" and r.text == text[:text.index(stop)]


def test_logprobs_legacy_format(oai):
    r = oai.completions.create(prompt="The service answers", max_tokens=5, logprobs=2, **GREEDY).choices[0]
    lp = r.logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert chosen <= 0 and len(top) >= 2
        assert chosen == pytest.approx(max(top.values()))  # greedy picks the most likely token
    assert "".join(lp.tokens) == r.text


def test_streaming_matches_non_streaming(oai):
    full = oai.completions.create(prompt="The service answers", max_tokens=10, **GREEDY)
    chunks = list(oai.completions.create(prompt="The service answers", max_tokens=10, stream=True,
                                         stream_options={"include_usage": True}, **GREEDY))
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in content) == full.choices[0].text
    assert sum((ids(c.choices[0]) for c in content), []) == ids(full.choices[0])
    assert content[-1].choices[0].finish_reason == "length"
    assert all(c.model_extra["weight_version"] == 0 for c in content)
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices


def test_vllm_bench_serve_request_and_stream_parsing(server):
    """`vllm bench serve --backend openai` (vLLM 0.32): its exact body (with vLLM's
    repetition_penalty) and its reading of the stream: SSE messages split on blank lines, every
    chunk with choices carries `text` (one chunk per token gives its ITL), a last chunk with
    empty choices carries usage.completion_tokens, then [DONE]."""
    from tests.test_server_protocol import VLLM_BENCH_SERVE_BODY

    with httpx.stream("POST", server.url + "/v1/completions", json=VLLM_BENCH_SERVE_BODY, timeout=120) as r:
        assert r.status_code == 200, r.read()
        raw = "".join(r.iter_text())
    messages = [m.strip() for m in raw.split("\n\n") if m.strip()]
    assert all(m.startswith("data: ") for m in messages) and messages[-1] == "data: [DONE]"
    data = [json.loads(m.removeprefix("data: ")) for m in messages[:-1]]
    content = [d for d in data if d.get("choices")]
    assert all(isinstance(d["choices"][0].get("text"), str) for d in content)
    assert sum(len(d["choices"][0]["token_ids"]) for d in content) == 8
    assert not data[-1]["choices"] and data[-1]["usage"]["completion_tokens"] == 8
    assert data[-1]["usage"]["prompt_tokens"] > 0


def test_chat_completion_with_logprobs_and_streaming(oai):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How are you today?"}]
    r = oai.chat.completions.create(messages=messages, max_tokens=6, logprobs=True, top_logprobs=2, **GREEDY)
    choice = r.choices[0]
    assert choice.message.role == "assistant" and r.usage.completion_tokens == 6
    assert len(choice.logprobs.content) == 6
    assert all(len(t.top_logprobs) == 2 and t.logprob == pytest.approx(t.top_logprobs[0].logprob)
               for t in choice.logprobs.content)
    stream = list(oai.chat.completions.create(messages=messages, max_tokens=6, stream=True, **GREEDY))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == choice.message.content


def test_error_statuses_and_bodies(oai, server):
    with pytest.raises(openai.UnprocessableEntityError, match="temperature"):
        oai.completions.create(model="tiny", prompt="x", temperature=-1)
    with pytest.raises(openai.UnprocessableEntityError, match="presence_penalty"):
        oai.completions.create(model="tiny", prompt="x", presence_penalty=0.5)
    with pytest.raises(openai.UnprocessableEntityError, match="bogus"):
        oai.completions.create(model="tiny", prompt="x", extra_body={"bogus": 1})
    with pytest.raises(openai.BadRequestError, match="max_model_len"):
        oai.completions.create(model="tiny", prompt=[5] * 4096)
    with pytest.raises(openai.BadRequestError, match="vocabulary"):
        oai.completions.create(model="tiny", prompt=[5, 10**6])
    with pytest.raises(openai.NotFoundError, match="not served"):
        oai.completions.create(model="other", prompt="x")
    with pytest.raises(openai.BadRequestError, match="role"):
        oai.chat.completions.create(model="tiny", messages=[{"role": "robot", "content": "x"}])
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    with pytest.raises(openai.BadRequestError, match="vision tower is not loaded"):
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": [
            {"type": "text", "text": "what is this?"}, image]}])
    body = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "x", "n": 0}).json()
    assert set(body["error"]) == {"message", "type", "param", "code"} and "n must be" in body["error"]["message"]


def _engine_requests(admin: Client) -> int:
    return admin.status()["engine"]["requests"]


def _wait_engine_idle(admin: Client, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while (n := _engine_requests(admin)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return n


def test_disconnecting_clients_abort_their_requests(server, admin):
    body = {"model": "tiny", "prompt": "The service answers", "max_tokens": 1500, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        lines = r.iter_lines()
        first = next(lines)
        assert first.startswith("data: ") and "error" not in first, first
        st = admin.status()
        assert st["engine"]["requests"] == 1, (first, st, [next(lines) for _ in range(3)])
    assert _wait_engine_idle(admin) == 0
    with pytest.raises(httpx.ReadTimeout):  # non-streaming: the server notices the closed socket
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(60, read=2.0))
    assert _wait_engine_idle(admin) == 0


def test_admin_api_needs_the_key(server):
    assert httpx.post(server.url + "/sleep?level=0").status_code == 401
    r = httpx.post(server.url + "/sleep?level=0", headers={"Authorization": "Bearer wrong"})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    with Client(server.url, "wrong") as c, pytest.raises(ServiceError) as e:
        c.is_sleeping()
    assert e.value.status == 401


def test_sleep_without_sleep_mode_is_refused_but_level0_pauses(admin, oai):
    with pytest.raises(ServiceError, match="sleep mode is off") as e:
        admin.sleep(1)
    assert e.value.status == 409
    admin.sleep(0)
    assert admin.is_sleeping()
    with pytest.raises(openai.InternalServerError, match="asleep") as e:
        oai.completions.create(prompt="x", max_tokens=2, **GREEDY)
    assert e.value.status_code == 503
    admin.wake_up()
    assert not admin.is_sleeping()
    assert oai.completions.create(prompt="x", max_tokens=2, **GREEDY).usage.completion_tokens == 2


def test_test_hooks_need_the_flag_and_diagnostics_are_allowed(admin):
    with pytest.raises(ServiceError, match="enable-test-hooks") as e:
        admin.collective_rpc("zero_tail_flags")
    assert e.value.status == 403
    with pytest.raises(ServiceError, match="unknown collective_rpc") as e:
        admin.collective_rpc("__init__")
    assert e.value.status == 422
    assert [p["rank"] for p in admin.collective_rpc("ping")] == [0, 1]


def test_health_and_metrics(server, admin):
    assert admin.health() == {"status": "ok", "state": "running"}
    text = admin.metrics()
    assert 'latentserve_requests_total{endpoint="completions",status="200"}' in text
    assert 'latentserve_requests_total{endpoint="completions",status="422"}' in text
    assert 'latentserve_requests_total{endpoint="chat",status="400"}' in text
    assert "latentserve_time_to_first_token_seconds_count" in text
    assert "latentserve_inter_token_latency_seconds_count" in text
    assert 'latentserve_state{latentserve_state="running"} 1.0' in text
    assert "latentserve_ranks_alive 2.0" in text


def test_status_splits_the_time_to_first_token(oai, admin):
    """A streamed request's first token is counted once by the controller (arrival to the route's
    start, then to admitted, and arrival to the first token) and once by the engine (queued, launched to landed, to the readers)."""
    before = admin.status()
    chunks = list(oai.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=3, stream=True))
    assert chunks
    after = admin.status()
    ctl = {k: after["first_token"][k] - before["first_token"][k] for k in before["first_token"]}
    eng = {k: after["engine"]["first_token"][k] - before["engine"]["first_token"][k]
           for k in before["engine"]["first_token"]}
    assert ctl["requests"] == 1 and eng["first_tokens"] == 1
    # http_s > 0: the stamp came before the route (without it arrival is the route's start)
    assert ctl["http_s"] > 0 and ctl["admit_s"] >= 0 and ctl["http_s"] + ctl["admit_s"] <= ctl["ttft_s"]
    assert eng["queue_s"] + eng["device_s"] + eng["report_s"] <= ctl["ttft_s"]
    assert after["process_cpu_s"] > before["process_cpu_s"] and after["loop_lag"]["samples"] >= before["loop_lag"]["samples"]


def test_async_client_generation_streaming_and_admin(server):
    import asyncio

    from service.client import AsyncClient

    async def run():
        async with AsyncClient(server.url, server.admin_key, timeout=120) as c:
            assert (await c.wait_ready(30))["status"] == "ok"
            full, streamed = await asyncio.gather(
                c.completions([[5, 6, 7]], max_tokens=6, temperature=0.0, ignore_eos=True),
                _collect(c.stream_completions([[5, 6, 7]], max_tokens=6, temperature=0.0, ignore_eos=True)))
            assert sum((ch["choices"][0]["token_ids"] for ch in streamed), []) == full["choices"][0]["token_ids"]
            assert not await c.is_sleeping()
            assert (await c.status())["tp"] == 2
            try:
                await c.sleep(1)
            except ServiceError as e:
                return e.status
        return None

    async def _collect(agen):
        return [x async for x in agen]

    assert asyncio.run(run()) == 409  # sleep mode is off on this server
