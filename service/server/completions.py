"""OpenAI routes: /v1/models, /v1/completions, /v1/chat/completions, streamed (SSE) or not.

Each HTTP request becomes one engine request per prompt (with its `n` samples); the poller
delivers cumulative outputs on the request's queue. A client that goes away aborts its
engine requests; every wait ends at the request deadline.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from ..outputs import RequestOutput
from ..sampling_params import SamplingParams
from .controller import Controller
from .protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    chat_response,
    completion_logprobs,
    completion_response,
    new_id,
    usage,
)
from .route import Failure, Route

router = APIRouter()
ENDPOINTS = {"/v1/completions": "completions", "/v1/chat/completions": "chat"}


def _controller(request: Request) -> Controller:
    return request.app.state.controller


def _check_model(ctl: Controller, model: str | None) -> None:
    if model not in (None, ctl.model_name, ctl.config.model):
        raise APIError(404, f"model {model!r} is not served here; this server serves {ctl.model_name!r}",
                       param="model", code="model_not_found")


@router.get("/v1/models")
async def models(request: Request) -> dict:
    ctl = _controller(request)
    card = {"id": ctl.model_name, "object": "model", "created": int(ctl.started), "owned_by": "latentserve",
            "root": ctl.config.model, "max_model_len": ctl.config.max_model_len,
            "weight_version": ctl.coordinator.state.weight_version}
    return {"object": "list", "data": [card]}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    ctl = _controller(request)
    _check_model(ctl, body.model)
    params = body.sampling_params()
    return await _serve(ctl, request, "completions", body.prompts(), params, body.stream, body.include_usage)


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    ctl = _controller(request)
    _check_model(ctl, body.model)
    params = body.sampling_params()
    ctl.check_generation()
    text = await ctl.rank0("apply_chat_template", body.template_messages())
    return await _serve(ctl, request, "chat", [(text, None)], params, body.stream, body.include_usage,
                        top_n=body.top_logprobs or 0)


async def _serve(ctl: Controller, request: Request, endpoint: str, prompts, params: SamplingParams,
                 stream: bool, include_usage: bool, top_n: int = 0):
    handler = time.monotonic()
    arrival = getattr(request.state, "arrival", handler)  # app.ArrivalStamp: before the body was read
    route = await ctl.submit(prompts, params, prefix="chatcmpl" if endpoint == "chat" else "cmpl")
    timer = _TokenTimer(ctl, endpoint, arrival, handler, admitted=time.monotonic())
    view = _View(ctl, endpoint, new_id("chatcmpl" if endpoint == "chat" else "cmpl"), top_n)
    if stream:
        gen = _stream(ctl, route, view, timer, include_usage, arrival + ctl.request_timeout_s)
        # The generator releases the route when it ends; the background task covers a client gone
        # before the generator ever started (then its `finally` never runs).
        return StreamingResponse(gen, media_type="text/event-stream", background=BackgroundTask(_release, ctl, route),
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    watcher = asyncio.create_task(_watch_disconnect(request, route))
    finals: dict[str, RequestOutput] = {}
    try:
        while len(finals) < len(route.request_ids):
            out = await ctl.next_output(route, arrival + ctl.request_timeout_s)
            timer.observe(out)
            if out.finished:
                route.finished.add(out.request_id)
                await ctl.check_output(out)
                finals[out.request_id] = out
        outs = [finals[rid] for rid in route.request_ids]
        timer.finish(outs)
        ctl.metrics.requests.labels(endpoint, "200").inc()  # errors are counted by the app's handlers
        return view.response(outs)
    finally:
        watcher.cancel()
        ctl.release(route)


async def _release(ctl: Controller, route: Route) -> None:
    ctl.release(route)  # on the event loop, like every other touch of the routes


async def _watch_disconnect(request: Request, route: Route) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.5)
    route.queue.put_nowait(Failure(499, "the client disconnected"))


_json = json.JSONEncoder(separators=(",", ":")).encode  # json.dumps builds an encoder a call for non-default separators


def _sse(obj) -> str:
    return f"data: {_json(obj)}\n\n"


async def _stream(ctl: Controller, route: Route, view: _View, timer: _TokenTimer, include_usage: bool,
                  deadline: float) -> AsyncIterator[str]:
    finals: dict[str, RequestOutput] = {}
    status = "200"
    try:
        while len(finals) < len(route.request_ids):
            out = await ctl.next_output(route, deadline)
            timer.observe(out)
            if out.finished:
                route.finished.add(out.request_id)
            if ctl.failed(out):
                await ctl.check_output(out)
            for event in view.events(route.request_ids.index(out.request_id), out):
                yield event
            if out.finished:
                finals[out.request_id] = out
        outs = [finals[rid] for rid in route.request_ids]
        timer.finish(outs)
        if include_usage:
            yield _sse({**view.head(), "choices": [], "usage": usage(outs)})
        yield "data: [DONE]\n\n"
    except APIError as e:
        status = str(e.status)
        yield _sse({**e.body(), "status": e.status})
        yield "data: [DONE]\n\n"
    finally:
        ctl.metrics.requests.labels(view.endpoint, status).inc()
        ctl.release(route)


class _View:
    """Shapes engine outputs as OpenAI responses and stream chunks (deltas of cumulative outputs)."""

    def __init__(self, ctl: Controller, endpoint: str, rid: str, top_n: int):
        self.ctl, self.endpoint, self.rid, self.top_n = ctl, endpoint, rid, top_n
        # A stream's chunk waits for this many new tokens (but its first and its last): at 256
        # streams one write a token a stream was a third of the HTTP process's time (py-spy, CPU).
        self.interval = ctl.stream_interval
        self.created = int(time.time())
        self.sent: dict[tuple[int, int], tuple[int, int]] = {}  # (prompt, choice) -> (tokens, chars)
        # Every chunk's event up to its choices, encoded once: the head's dict merged and encoded
        # again each token was most of a chunk's cost.
        self._open = "data: " + _json(self.head())[:-1] + ',"choices":['
        self._version, self._close = object(), ""  # the events' end, encoded again when the version changes

    def head(self) -> dict:
        obj = "chat.completion.chunk" if self.endpoint == "chat" else "text_completion"
        return {"id": self.rid, "object": obj, "created": self.created, "model": self.ctl.model_name}

    def response(self, outs: list[RequestOutput]) -> dict:
        if self.endpoint == "chat":
            r = chat_response(self.rid, self.ctl.model_name, outs[0], self.ctl.token_text, self.top_n)
        else:
            r = completion_response(self.rid, self.ctl.model_name, outs, self.ctl.token_text)
        r["created"] = self.created
        return r

    def chunks(self, p: int, out: RequestOutput) -> list[dict]:
        return [{**self.head(), "choices": [c], "weight_version": out.weight_version} for c in self._choices(p, out)]

    def events(self, p: int, out: RequestOutput) -> list[str]:
        """`chunks` as their SSE events, byte for byte, the head encoded once (`_open`)."""
        if out.weight_version != self._version:
            self._version = out.weight_version
            self._close = f'],"weight_version":{_json(out.weight_version)}}}\n\n'
        return [self._open + _json(c) + self._close for c in self._choices(p, out)]

    def _choices(self, p: int, out: RequestOutput) -> list[dict]:
        choices = []
        n = len(out.outputs)
        for c in out.outputs if n == 1 else sorted(out.outputs, key=lambda c: c.index):
            key = (p, c.index)
            first = key not in self.sent
            tokens, chars = self.sent.get(key, (0, 0))
            text = c.text or ""
            if len(c.token_ids) - tokens < self.interval and not c.finish_reason and not first:
                continue
            self.sent[key] = (len(c.token_ids), len(text))
            delta_text, delta_ids = text[chars:], c.token_ids[tokens:]
            choice = {"index": p * n + c.index, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                      "token_ids": delta_ids}
            if self.endpoint == "chat":
                choice["delta"] = {"role": "assistant", "content": delta_text} if first else {"content": delta_text}
                choice["logprobs"] = chat_logprobs(c, tokens, self.ctl.token_text, self.top_n)
            else:
                choice["text"] = delta_text
                choice["logprobs"] = completion_logprobs(c, tokens, self.ctl.token_text, chars)
            choices.append(choice)
        return choices


class _TokenTimer:
    """Time to first token and inter-token latency as the controller sees them."""

    def __init__(self, ctl: Controller, endpoint: str, arrival: float, handler: float, admitted: float):
        self.metrics = ctl.metrics
        self.first_token = ctl.first_token
        self.endpoint = endpoint
        # arrival: the ASGI app first saw the request; handler: the route began (body read and
        # validated, a chat's template applied); admitted: rank 0 holds the request
        self.arrival, self.handler, self.admitted = arrival, handler, admitted
        self.last: float | None = None
        self.tokens: dict[tuple[str, int], int] = {}

    def observe(self, out: RequestOutput) -> None:
        now = time.monotonic()
        new = 0
        for c in out.outputs:
            key = (out.request_id, c.index)
            new += len(c.token_ids) - self.tokens.get(key, 0)
            self.tokens[key] = len(c.token_ids)
        if new <= 0:
            return
        if self.last is None:
            self.metrics.ttft.observe(now - self.arrival)
            ft = self.first_token
            ft["requests"] += 1
            ft["http_s"] += self.handler - self.arrival
            ft["admit_s"] += self.admitted - self.handler
            ft["ttft_s"] += now - self.arrival
        else:
            for _ in range(new):
                self.metrics.itl.observe((now - self.last) / new)
        self.last = now

    def finish(self, outs: list[RequestOutput]) -> None:
        u = usage(outs)
        self.metrics.prompt_tokens.inc(u["prompt_tokens"])
        self.metrics.generation_tokens.inc(u["completion_tokens"])
        self.metrics.request_latency.labels(self.endpoint).observe(time.monotonic() - self.arrival)
