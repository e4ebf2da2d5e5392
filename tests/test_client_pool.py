"""`AsyncClient` keeps many concurrent streams on their own connections (service/client.py's
_Lanes). httpcore 1.0's shared pool offers every request queued at one moment the same idle
connection, and all but one fail to claim it and retry; streams that end together queue together.
Against a plain SSE server on uvicorn whose streams all end at the same instant: through the
product's client no claim fails, all the streams are open at once and later rounds reuse the
first round's connections; the same load through one bare httpx client with the same limits (the
negative control) shows the failed claims."""

from __future__ import annotations

import asyncio
import collections
import threading
import time

import httpcore
import httpx
import pytest
import uvicorn
from httpcore._async import http11

from service.client import AsyncClient, _limits
from service.net import free_port

STREAMS, ROUNDS = 32, 3


class _SSE:
    """POST /v1/completions answers two SSE chunks and ends on the next 50 ms boundary, so every
    stream of a round ends together. Counts the streams open at once."""

    def __init__(self):
        self.open = self.most_open = 0
        self.clients = set()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return
        self.clients.add(tuple(scope["client"]))  # (host, port): one a connection
        while (await receive()).get("more_body"):
            pass
        self.open += 1
        self.most_open = max(self.most_open, self.open)
        try:
            await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
            await send({"type": "http.response.body", "body": b'data: {"choices": [{"token_ids": [1]}]}\n\n',
                        "more_body": True})
            await asyncio.sleep(0.05 - time.time() % 0.05 + 0.01)
            await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})
        finally:
            self.open -= 1


@pytest.fixture(scope="module")
def server():
    app = _SSE()
    port = free_port()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the test server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", app
    srv.should_exit = True
    thread.join(10)


@pytest.fixture
def failed_claims(monkeypatch):
    counts = collections.Counter()
    handle = http11.AsyncHTTP11Connection.handle_async_request

    async def counted(self, request):
        try:
            return await handle(self, request)
        except httpcore.ConnectionNotAvailable:
            counts["failed"] += 1
            raise

    monkeypatch.setattr(http11.AsyncHTTP11Connection, "handle_async_request", counted)
    return counts


async def _product(url: str) -> None:
    async with AsyncClient(url, max_connections=STREAMS + 4) as c:
        async def stream():
            for _ in range(ROUNDS):
                chunks = [chunk async for chunk in c.stream_completions([[1, 2]], max_tokens=1)]
                assert chunks == [{"choices": [{"token_ids": [1]}]}]
        await asyncio.gather(*(stream() for _ in range(STREAMS)))


async def _bare(url: str) -> None:
    async with httpx.AsyncClient(base_url=url, limits=_limits(STREAMS + 4), timeout=60) as c:
        async def stream():
            for _ in range(ROUNDS):
                async with c.stream("POST", "/v1/completions", json={"prompt": [[1, 2]], "stream": True}) as r:
                    async for _ in r.aiter_lines():
                        pass
        await asyncio.gather(*(stream() for _ in range(STREAMS)))


def test_concurrent_streams_claim_their_connections_without_retries(server, failed_claims):
    url, app = server
    app.most_open, app.clients = 0, set()
    asyncio.run(_product(url))
    assert failed_claims["failed"] == 0
    assert app.most_open == STREAMS
    assert len(app.clients) == STREAMS  # ROUNDS x STREAMS requests, each stream's lane kept its connection


def test_negative_control_the_bare_pool_retries_its_claims(server, failed_claims):
    url, _ = server
    asyncio.run(_bare(url))
    assert failed_claims["failed"] > 0


def test_streams_beyond_max_connections_wait_for_a_free_lane(server):
    url, app = server
    app.most_open, app.clients = 0, set()

    async def load():
        async with AsyncClient(url, max_connections=4) as c:
            async def stream():
                return [chunk async for chunk in c.stream_completions([[1, 2]], max_tokens=1)]
            return await asyncio.gather(*(stream() for _ in range(12)))

    outs = asyncio.run(load())
    assert all(out == [{"choices": [{"token_ids": [1]}]}] for out in outs)
    assert app.most_open == 4 and len(app.clients) == 4
