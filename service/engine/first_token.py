"""Where a request's time to first token goes inside the engine, summed over requests.

Served on a GPU with async output, TTFT p50 at 256 streams stayed +50% over in-order steps
after two mends that a simulation said would close it (bench/RESULTS.md, runs 69 and 75): the
client's TTFT alone cannot say which part grew. Each request's first token passes four marks in
rank 0's process: added (add_request), launched (the step that samples it is handed to the
executor), landed (sampled on the host) and out (handed to the engine loop's readers). The
sums of the three gaps, with the controller's own admit and TTFT sums (its /status), split
the client's TTFT; `bench/serve.py` prints the means of a load.
"""

from __future__ import annotations

import time

from .scheduler import ScheduledBatch

_KEEP = 1 << 16  # requests that never reach a first token (aborted while queued) are forgotten past this


class FirstTokenClock:
    def __init__(self) -> None:
        self._added: dict[str, float] = {}
        self._landed: dict[str, tuple[float, float, float]] = {}  # request -> (added, launched, landed)
        self.totals = {"first_tokens": 0, "queue_s": 0.0, "device_s": 0.0, "report_s": 0.0}

    def added(self, request_id: str) -> None:
        if len(self._added) >= _KEEP:
            for rid in list(self._added)[: _KEEP // 2]:  # the oldest half: insertion order
                del self._added[rid]
        self._added[request_id] = time.monotonic()

    def launched(self, batch: ScheduledBatch) -> None:
        """A prefill or mixed batch is about to be handed to the executor (decode steps carry no
        first token): its launch, host part included, counts as device time."""
        firsts = [s.request_id for s, c in zip(batch.seqs, batch.plan.chunks)
                  if c.needs_logits and not s.output_token_ids and s.request_id in self._added]
        if firsts:
            batch.first_tokens = (time.monotonic(), firsts)

    def landed(self, batch: ScheduledBatch) -> None:
        if batch.first_tokens is None:
            return
        (launched, firsts), now = batch.first_tokens, time.monotonic()
        if len(self._landed) >= _KEEP:  # an engine without a loop (offline) never marks `out`
            self._landed.clear()
        for rid in firsts:
            added = self._added.pop(rid, None)
            if added is not None:
                self._landed[rid] = (added, launched, now)

    def out(self, outputs: list) -> None:
        """These outputs reach the engine loop's readers now."""
        if not self._landed:
            return
        now, t = time.monotonic(), self.totals
        for o in outputs:
            marks = self._landed.pop(o.request_id, None)
            if marks is not None:
                added, launched, landed = marks
                t["first_tokens"] += 1
                t["queue_s"] += launched - added
                t["device_s"] += landed - launched
                t["report_s"] += now - landed

    def stats(self) -> dict:
        return {k: round(v, 6) if isinstance(v, float) else v for k, v in self.totals.items()}
