"""A streamed or waited-for HTTP request's route: the queue the poller puts its outputs on, and
each of its engine requests' whole output so far (the engine loop reports progress as deltas)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from ..outputs import RequestOutput


@dataclass
class Failure:
    """Put into a request's queue when the request cannot finish (rank death, restart)."""

    status: int
    message: str


@dataclass
class Route:
    queue: asyncio.Queue
    loop: asyncio.AbstractEventLoop
    request_ids: list[str] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)  # engine requests that reported their end
    admitted: bool = False
    released: bool = False
    whole: dict[str, RequestOutput] = field(default_factory=dict)  # per engine request, deltas applied
    deadline: asyncio.TimerHandle | None = None  # puts the 504 into the queue; release cancels it

    def accumulate(self, out: RequestOutput) -> RequestOutput:
        """The whole output so far: the engine loop reports a stream's progress as deltas."""
        if not out.delta:
            self.whole[out.request_id] = out
            return out
        whole = self.whole.get(out.request_id)
        if whole is None:
            out.delta = False
            self.whole[out.request_id] = out
            return out
        whole.extend(out)
        return whole

    def advance(self, request_id: str, token_ids: list[int], text: str | None, logprobs: list | None,
                weight_version: int) -> RequestOutput:
        """`accumulate` for an OutputBatch row: a one-sample delta given by its parts, whose
        request's first output (never a row) came before it."""
        whole = self.whole.get(request_id)
        if whole is None:
            whole = self.whole[request_id] = RequestOutput(request_id, None, [], weight_version=weight_version)
        whole.advance(token_ids, text, logprobs, weight_version)
        return whole
