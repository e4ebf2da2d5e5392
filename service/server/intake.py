"""New engine requests into rank 0, many to an RPC.

Each HTTP request was one add_request RPC a prompt, awaited in turn. At 256 streams arrivals come
in waves (streams of one length finish together), and every RPC is a pipe message that rank 0's
reader and one of its pool threads must take the GIL for, beside an engine thread that async
output keeps busy; served on an H100 (run 75) async output's TTFT p50 was 1.5x in order's there.
While one `add_requests` RPC is in flight, the arrivals behind it gather and go in the next
(LATENTSERVE_INTAKE_BATCH=0: an RPC each, at once, a bench baseline).
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable

from .protocol import APIError


class Intake:
    def __init__(self, call: Callable[..., Awaitable], as_error: Callable[[BaseException], APIError]):
        self._call = call  # Controller.rank0: (method, *args) -> its result, APIError on failure
        self._as_error = as_error  # an engine's refusal of one request -> its HTTP error
        self._waiting: list[tuple[tuple, asyncio.Future]] = []
        self._sender: asyncio.Task | None = None
        self.stats = {"requests": 0, "rpcs": 0}

    async def add(self, items: list[tuple]) -> None:
        """Queue engine requests (request_id, prompt, prompt_token_ids, params); return once rank 0
        holds all of them, or raise the first one's error (the others may be in: abort them)."""
        if os.environ.get("LATENTSERVE_INTAKE_BATCH", "1") == "0":  # the build before: an RPC each, in turn
            for one in items:
                self.stats["rpcs"] += 1
                self.stats["requests"] += 1
                refused = (await self._call("add_requests", [one]))[0]
                if refused is not None:
                    raise self._as_error(refused)
            return
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in items]
        self._waiting += zip(items, futures)
        if self._sender is None:
            self._sender = loop.create_task(self._send(), name="intake")
        for outcome in await asyncio.gather(*futures, return_exceptions=True):
            if isinstance(outcome, BaseException):
                raise outcome

    async def _send(self) -> None:
        try:
            while self._waiting:
                batch, self._waiting = self._waiting, []
                self.stats["rpcs"] += 1
                self.stats["requests"] += len(batch)
                try:
                    refused = await self._call("add_requests", [item for item, _ in batch])
                except asyncio.CancelledError:
                    _settle(batch, [APIError(503, "the server is shutting down")] * len(batch))
                    raise
                except APIError as e:  # rank 0 dead, late, or refusing them all (asleep, paused)
                    refused = [e] * len(batch)
                except Exception as e:  # never leave a request waiting on an answer that cannot come
                    refused = [APIError(500, f"rank 0 add_requests failed: {type(e).__name__}: {e}")] * len(batch)
                if not isinstance(refused, list) or len(refused) != len(batch):
                    refused = [APIError(500, f"rank 0 answered add_requests with {refused!r:.200}")] * len(batch)
                _settle(batch, [None if r is None else r if isinstance(r, APIError) else self._as_error(r)
                                for r in refused])
        finally:
            self._sender = None


def _settle(batch: list[tuple[tuple, asyncio.Future]], errors: list) -> None:
    for (_, future), error in zip(batch, errors):
        if future.done():  # its HTTP request gave up meanwhile
            continue
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
