"""Concurrency through HTTP against one TP-2 server: sleeps and wakes racing each other while
streams are in flight. Every transition answers 200 or an OpenAI-shaped 409 (the one that gets
there first wins; one arriving meanwhile is refused at once, nothing interleaves on the ranks);
after every round each rank reports what the coordinator reports, never a half-slept cluster;
the streams (kept across the sleeps) and later requests give the greedy tokens of before, and a
completion sent into the race is served or refused with the model's state (503), never a 500."""

from __future__ import annotations

import asyncio
import random
import time

import pytest

from service.client import AsyncClient, ServiceError

PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
STREAMS = [[20, 21, 22], [30, 31], [40, 41, 42, 43]]
STREAM_TOKENS = 800  # still streaming when a loaded machine's first status poll answers
ROUNDS = 8
GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def server(server_factory):
    # Async output on (the CUDA default; auto is off on the CPU): pauses for the sleeps must first
    # collect the step in flight, and kept streams must lose no token across them.
    return server_factory("--enable-sleep-mode", "--async-output", "on")


async def _tokens(c: AsyncClient, prompts, max_tokens: int) -> list[list[int]]:
    r = await c.completions(prompts, max_tokens=max_tokens, **GREEDY)
    return [ch["token_ids"] for ch in sorted(r["choices"], key=lambda ch: ch["index"])]


async def _stream(c: AsyncClient, prompt: list[int]) -> list[int]:
    tokens: list[int] = []
    async for chunk in c.stream_completions([prompt], max_tokens=STREAM_TOKENS, **GREEDY):
        for ch in chunk["choices"]:
            tokens += ch.get("token_ids") or []
    return tokens


async def _answer(call) -> tuple[int, dict]:
    """(HTTP status, body) of one admin call; anything but 200 or a 409 fails the test."""
    try:
        return 200, await call
    except ServiceError as e:
        assert e.status == 409, f"HTTP {e.status}: {e.message}"
        err = e.body["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"], e.body
        assert "in progress" in err["message"] or "already asleep" in err["message"], err
        return 409, e.body


async def _request(c: AsyncClient) -> tuple[int, object]:
    """A completion sent into the race: served (kept across a sleep if admitted before it), or
    refused with the model's state (503 asleep or paused, retry): never a 500."""
    try:
        return 200, await _tokens(c, PROMPTS[:1], 8)
    except ServiceError as e:
        assert e.status == 503 and e.body["error"]["code"] == "model_state", f"HTTP {e.status}: {e.message}"
        return 503, e.message


def _consistent(status: dict) -> None:
    """Nothing in progress, every rank asleep exactly as the coordinator says: never half slept."""
    assert status["busy"] is None, status
    asleep = [sorted(r["asleep"]) for r in status["ranks"]]
    assert asleep == [status["tags_asleep"]] * len(asleep), (asleep, status["tags_asleep"])
    assert status["state"] == ("sleeping" if status["tags_asleep"] else "running"), status
    assert (status["sleep_level"] is not None) == bool(status["tags_asleep"]), status


async def _race(url: str, key: str) -> dict:
    async with AsyncClient(url, key, timeout=300) as c:
        reference = await _tokens(c, PROMPTS, 8)
        stream_reference = await _tokens(c, STREAMS, STREAM_TOKENS)
        streams = [asyncio.create_task(_stream(c, p)) for p in STREAMS]
        deadline = time.monotonic() + 120
        while (await c.status())["engine"]["running"] < 1:  # in flight before the race starts
            # bounded: a stream that ended before any poll saw it running must fail here, not hang
            # the module until pytest's timeout (it did once, with two CI runs on 2 cores)
            assert time.monotonic() < deadline and not all(s.done() for s in streams), "no stream seen running"
            await asyncio.sleep(0.05)
        rng = random.Random(14)
        seen: list[tuple[str, int]] = []
        kept: list[int] = []
        requests = []  # not awaited per round: one kept across a sleep waits for a later wake
        for _ in range(ROUNDS):
            ops = ["sleep", "sleep", "wake_up", "wake_up"]
            rng.shuffle(ops)
            requests.append(asyncio.create_task(_request(c)))
            calls = [c.sleep(1, mode="keep") if op == "sleep" else c.wake_up() for op in ops]
            answers = await asyncio.gather(*(_answer(call) for call in calls))
            seen += [(op, status) for op, (status, _) in zip(ops, answers)]
            kept += [body["engine"]["kept"] for op, (status, body) in zip(ops, answers)
                     if op == "sleep" and status == 200]
            _consistent(await c.status())
        if (await c.status())["tags_asleep"]:
            woke = await c.wake_up()
            assert woke["state"] == "running"
        streamed = await asyncio.gather(*streams)
        served = await asyncio.gather(*requests)
        final = await c.status()
        _consistent(final)
        assert final["engine"]["async_output"], final["engine"]
        return {"reference": reference, "again": await _tokens(c, PROMPTS, 8), "streamed": streamed,
                "stream_reference": stream_reference, "seen": seen, "kept": kept, "served": served,
                "final": final}


def test_racing_sleeps_and_wakes_with_streams_in_flight(server):
    r = asyncio.run(_race(server.url, server.admin_key))
    seen = r["seen"]
    print("answers:", seen)
    assert ("sleep", 200) in seen and ("wake_up", 200) in seen
    assert any(status == 409 for _, status in seen), "no call met another one in progress"
    assert max(r["kept"]) >= 1, "no sleep met a stream in flight"
    print("racing completions:", [status for status, _ in r["served"]])
    assert all(tokens == r["reference"][:1] for status, tokens in r["served"] if status == 200)
    final = r["final"]
    assert final["state"] == "running" and final["failed"] is None
    assert all(rank["weights_valid"] and rank["recoveries"] == 0 for rank in final["ranks"])
    assert len({repr(rank["tail_epochs"]) for rank in final["ranks"]}) == 1
    assert r["streamed"] == r["stream_reference"]  # parked across the sleeps, recomputed, the same
    assert r["again"] == r["reference"]
