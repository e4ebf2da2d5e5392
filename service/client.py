"""Python clients for a latentserve server: generation plus the RLHF admin loop.

    c = Client("http://127.0.0.1:8000", admin_key=KEY)
    c.completions([[1, 2, 3]], max_tokens=16, temperature=0)
    c.sleep(level=2); ...train...; c.wake_up(["weights"])
    c.update_weights(path=CKPT); c.wake_up(["kv_cache"])

`AsyncClient` has the same methods as coroutines, plus `stream_completions`. Any error answer
raises `ServiceError(status, message)` with the server's body (per-rank outcomes included).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass

import httpx


class ServiceError(RuntimeError):
    def __init__(self, status: int, message: str, body: dict | None = None):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status
        self.message = message
        self.body = body or {}

    @property
    def ranks(self) -> list[dict] | None:
        return self.body.get("ranks")


@dataclass
class _Call:
    method: str
    path: str
    params: dict | list | None = None
    json: dict | None = None
    admin: bool = False


def _result(r: httpx.Response):
    if r.status_code >= 400:
        try:
            body = r.json()
        except ValueError:
            body = {"error": {"message": r.text}}
        err = body.get("error") if isinstance(body, dict) else None
        message = err.get("message") if isinstance(err, dict) else str(body)
        raise ServiceError(r.status_code, message, body if isinstance(body, dict) else None)
    if r.headers.get("content-type", "").startswith("application/json"):
        return r.json()
    return r.text


def _sse_data(line: str):
    """The JSON of one `data:` line, None for other lines and [DONE]; raises on an error event."""
    if not line.startswith("data:"):
        return None
    data = line[5:].strip()
    if data == "[DONE]":
        return None
    obj = json.loads(data)
    if "error" in obj:
        raise ServiceError(int(obj.get("status", 500)), obj["error"].get("message", ""), obj)
    return obj


class _Calls:
    """The HTTP shape of every operation, shared by the sync and async clients."""

    @staticmethod
    def completions(prompt, **params) -> _Call:
        return _Call("POST", "/v1/completions", json={"prompt": prompt, **params})

    @staticmethod
    def chat(messages, **params) -> _Call:
        return _Call("POST", "/v1/chat/completions", json={"messages": messages, **params})

    @staticmethod
    def sleep(level: int, mode: str, timeout: float | None) -> _Call:
        params = {"level": level, "mode": mode, **({"timeout": timeout} if timeout else {})}
        return _Call("POST", "/sleep", params=params, admin=True)

    @staticmethod
    def wake_up(tags, timeout: float | None) -> _Call:
        params = [("tags", t) for t in (tags or [])] + ([("timeout", timeout)] if timeout else [])
        return _Call("POST", "/wake_up", params=params, admin=True)

    @staticmethod
    def update_weights(source: dict) -> _Call:
        return _Call("POST", "/update_weights", json=source, admin=True)

    @staticmethod
    def collective_rpc(method: str, args, ranks, timeout) -> _Call:
        body = {"method": method, "args": list(args), "ranks": ranks, "timeout": timeout}
        return _Call("POST", "/collective_rpc", json={k: v for k, v in body.items() if v is not None}, admin=True)


class _Base:
    def __init__(self, base_url: str, admin_key: str | None, model: str | None):
        self.base_url = base_url.rstrip("/")
        self.admin_key = admin_key
        self.model = model

    def _headers(self, call: _Call) -> dict:
        if call.admin and self.admin_key:
            return {"Authorization": f"Bearer {self.admin_key}"}
        return {}

    def _with_model(self, params: dict) -> dict:
        if self.model and "model" not in params:
            params = {"model": self.model, **params}
        return params


# The server keeps idle connections for SERVER_KEEP_ALIVE_S; the client drops them well before,
# so it never sends a request on a connection the server is closing at that very moment
# (seen as "Server disconnected without sending a response" after an idle pause).
SERVER_KEEP_ALIVE_S = 30
CLIENT_KEEP_ALIVE_S = 10.0


def _limits(max_connections: int) -> httpx.Limits:
    return httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections,
                        keepalive_expiry=CLIENT_KEEP_ALIVE_S)


class _Lanes:
    """One connection per concurrent request: a free lane (an httpx client of one connection) is
    taken without waiting, a new one made when none is free, up to `max_lanes`.

    httpcore 1.0's shared pool offers every request queued at one moment the first idle
    connection; one claims it and the others fail, clear and retry, one event-loop turn each.
    Streams that end together queue together, so at 64 concurrent streams through one pool new
    requests waited 0.2-1.4 s before their first byte was sent, with ~1,500 failed claims per 256
    requests, and the server saw a fraction of the streams (bench/RESULTS.md, 2026-12-06). Letting
    one request at a time into the pool ended the failed claims but still cost a loop turn per
    request (50-150 ms at 64 streams); a lane costs none. The lanes share one TLS context."""

    def __init__(self, base_url: str, timeout: float, max_lanes: int):
        self._base_url, self._timeout = base_url, timeout
        self._ssl = httpx.create_ssl_context()
        self._idle: list[httpx.AsyncClient] = []
        self._all: list[httpx.AsyncClient] = []
        self._free = asyncio.Semaphore(max_lanes)  # waits only while every lane is busy

    def _new(self) -> httpx.AsyncClient:
        http = httpx.AsyncClient(base_url=self._base_url, timeout=self._timeout, limits=_limits(1), verify=self._ssl)
        self._all.append(http)
        return http

    @contextlib.asynccontextmanager
    async def lane(self):
        await self._free.acquire()
        try:
            http = self._idle.pop() if self._idle else self._new()
            try:
                yield http
            finally:
                self._idle.append(http)
        finally:
            self._free.release()

    async def aclose(self) -> None:
        for http in self._all:
            await http.aclose()


class Client(_Base):
    def __init__(self, base_url: str, admin_key: str | None = None, timeout: float = 600.0,
                 model: str | None = None):
        super().__init__(base_url, admin_key, model)
        self._http = httpx.Client(base_url=self.base_url, timeout=timeout, limits=_limits(10))

    def _do(self, call: _Call):
        return _result(self._http.request(call.method, call.path, params=call.params, json=call.json,
                                          headers=self._headers(call)))

    # generation
    def completions(self, prompt, **params) -> dict:
        return self._do(_Calls.completions(prompt, **self._with_model(params)))

    def chat(self, messages: list[dict], **params) -> dict:
        return self._do(_Calls.chat(messages, **self._with_model(params)))

    def stream_completions(self, prompt, **params) -> Iterator[dict]:
        call = _Calls.completions(prompt, **self._with_model(params), stream=True)
        with self._http.stream(call.method, call.path, json=call.json) as r:
            if r.status_code >= 400:
                r.read()
                _result(r)
            for line in r.iter_lines():
                obj = _sse_data(line)
                if obj is not None:
                    yield obj

    def models(self) -> dict:
        return self._do(_Call("GET", "/v1/models"))

    # admin
    def sleep(self, level: int = 1, mode: str = "abort", timeout: float | None = None) -> dict:
        return self._do(_Calls.sleep(level, mode, timeout))

    def wake_up(self, tags: list[str] | None = None, timeout: float | None = None) -> dict:
        return self._do(_Calls.wake_up(tags, timeout))

    def is_sleeping(self) -> bool:
        return self._do(_Call("GET", "/is_sleeping", admin=True))["is_sleeping"]

    def pause(self, mode: str = "keep") -> dict:
        return self._do(_Call("POST", "/pause", params={"mode": mode}, admin=True))

    def resume(self) -> dict:
        return self._do(_Call("POST", "/resume", admin=True))

    def update_weights(self, path: str | None = None, **source) -> dict:
        return self._do(_Calls.update_weights({"path": path, **source} if path else source))

    def update_weights_from_group(self, named_tensors, **kwargs) -> dict:
        """Broadcast tensors to the ranks through a process group (see service.weights.sync.push_via_group)."""
        from .weights.sync import push_via_group

        return push_via_group(self, named_tensors, **kwargs)

    def update_weights_from_refs(self, named_tensors) -> dict:
        """Send tensors as Ray object refs; call from inside the service's Ray cluster."""
        from .weights.sync import push_via_refs

        return push_via_refs(self, named_tensors)

    def status(self) -> dict:
        return self._do(_Call("GET", "/v1/status", admin=True))

    def collective_rpc(self, method: str, *args, ranks: list[int] | None = None,
                       timeout: float | None = None) -> list:
        return self._do(_Calls.collective_rpc(method, args, ranks, timeout))["results"]

    def restart(self) -> dict:
        return self._do(_Call("POST", "/restart", admin=True))

    def metrics(self) -> str:
        return self._do(_Call("GET", "/metrics"))

    def health(self) -> dict:
        """{"status": "ok" | "unhealthy", ...}; never raises for an unhealthy (503) answer."""
        r = self._http.get("/health")
        return r.json()

    def wait_ready(self, timeout: float = 300.0, interval: float = 0.5) -> dict:
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                h = self.health()
                if h.get("status") == "ok":
                    return h
                last = h.get("reason") or h.get("status")
            except (httpx.HTTPError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
            time.sleep(interval)
        raise TimeoutError(f"{self.base_url} not ready within {timeout}s ({last})")

    def close(self) -> None:
        self._http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncClient(_Base):
    def __init__(self, base_url: str, admin_key: str | None = None, timeout: float = 600.0,
                 model: str | None = None, max_connections: int = 256):
        super().__init__(base_url, admin_key, model)
        self._lanes = _Lanes(self.base_url, timeout, max_connections)

    async def _do(self, call: _Call):
        async with self._lanes.lane() as http:
            return _result(await http.request(call.method, call.path, params=call.params, json=call.json,
                                              headers=self._headers(call)))

    async def completions(self, prompt, **params) -> dict:
        return await self._do(_Calls.completions(prompt, **self._with_model(params)))

    async def chat(self, messages: list[dict], **params) -> dict:
        return await self._do(_Calls.chat(messages, **self._with_model(params)))

    async def stream_completions(self, prompt, **params) -> AsyncIterator[dict]:
        call = _Calls.completions(prompt, **self._with_model(params), stream=True)
        async with self._lanes.lane() as http, http.stream(call.method, call.path, json=call.json) as r:
            if r.status_code >= 400:
                await r.aread()
                _result(r)
            async for line in r.aiter_lines():
                obj = _sse_data(line)
                if obj is not None:
                    yield obj

    async def models(self) -> dict:
        return await self._do(_Call("GET", "/v1/models"))

    async def sleep(self, level: int = 1, mode: str = "abort", timeout: float | None = None) -> dict:
        return await self._do(_Calls.sleep(level, mode, timeout))

    async def wake_up(self, tags: list[str] | None = None, timeout: float | None = None) -> dict:
        return await self._do(_Calls.wake_up(tags, timeout))

    async def is_sleeping(self) -> bool:
        return (await self._do(_Call("GET", "/is_sleeping", admin=True)))["is_sleeping"]

    async def pause(self, mode: str = "keep") -> dict:
        return await self._do(_Call("POST", "/pause", params={"mode": mode}, admin=True))

    async def resume(self) -> dict:
        return await self._do(_Call("POST", "/resume", admin=True))

    async def update_weights(self, path: str | None = None, **source) -> dict:
        return await self._do(_Calls.update_weights({"path": path, **source} if path else source))

    async def status(self) -> dict:
        return await self._do(_Call("GET", "/v1/status", admin=True))

    async def collective_rpc(self, method: str, *args, ranks: list[int] | None = None,
                             timeout: float | None = None) -> list:
        return (await self._do(_Calls.collective_rpc(method, args, ranks, timeout)))["results"]

    async def restart(self) -> dict:
        return await self._do(_Call("POST", "/restart", admin=True))

    async def metrics(self) -> str:
        return await self._do(_Call("GET", "/metrics"))

    async def health(self) -> dict:
        async with self._lanes.lane() as http:
            return (await http.get("/health")).json()

    async def wait_ready(self, timeout: float = 300.0, interval: float = 0.5) -> dict:
        deadline = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < deadline:
            try:
                h = await self.health()
                if h.get("status") == "ok":
                    return h
                last = h.get("reason") or h.get("status")
            except (httpx.HTTPError, ValueError) as e:
                last = f"{type(e).__name__}: {e}"
            await asyncio.sleep(interval)
        raise TimeoutError(f"{self.base_url} not ready within {timeout}s ({last})")

    async def aclose(self) -> None:
        await self._lanes.aclose()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.aclose()
