"""The engine loop on rank 0: a thread that steps the engine while there is work.

Clients (the offline LLM, the HTTP controller) add requests and long-poll for outputs. Pause
stops stepping between two steps, which is what makes a sleep safe: no forward is running
on any rank once `pause()` returns.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict

from ..engine.llm_engine import LLMEngine
from ..lifecycle import EngineStateError
from ..log import get_logger
from ..outputs import RequestOutput
from ..sampling_params import SamplingParams

log = get_logger("engine")
# How long a step's hand-over waits for a reader (add, poll) to let go of _cv: their critical
# sections are microseconds, but a holder descheduled by the GIL keeps it up to a switch interval.
HANDOVER_WAIT_S = 0.005


class EngineLoop:
    def __init__(self, engine: LLMEngine, weight_version, refusal=lambda: None):
        self.engine = engine
        # callable -> reason the ranks cannot run a forward now (asleep, weights discarded), or None
        self._refusal = refusal
        self._weight_version = weight_version  # callable: the version stamped on outputs
        self._cv = threading.Condition()
        self._paused = False
        self._stepping = False
        self._stop = False
        self._outputs: list[RequestOutput] = []
        self._finished: dict[str, RequestOutput] = {}
        self._waiters: dict[str, threading.Event] = defaultdict(threading.Event)
        # generate() waiters read final outputs only (see _publish).
        engine.wants_progress = lambda request_id: request_id not in self._waiters
        engine.progress_deltas = True  # poll() feeds the HTTP controller, which rebuilds whole outputs
        engine.publish = self._publish_from_step
        self.last_error: str | None = None
        self.steps = 0
        self.handovers = {"taken": 0, "refused": 0}  # LLMEngine.publish calls, see _publish_from_step
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # ---- requests -----------------------------------------------------------------
    def _check_accepting(self) -> None:
        reason = self._refusal()
        if reason:
            raise EngineStateError(reason)
        if self._paused:
            raise EngineStateError("the engine is paused: resume it (or wake it up) before generating")

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
            params: SamplingParams) -> None:
        with self._cv:
            self._check_accepting()
            self.engine.add_request(request_id, prompt, prompt_token_ids, params)
            self._cv.notify_all()

    def abort(self, request_ids: list[str]) -> None:
        # Outside _cv: an abort waits for a running step (the engine's lock), and holding _cv
        # through it would stall the loop's publishing and every poll for that step.
        for rid in request_ids:
            self.engine.abort_request(rid)
        with self._cv:
            self._cv.notify_all()

    def poll(self, timeout: float = 1.0) -> list[RequestOutput]:
        """New outputs since the last poll (cumulative per request), waiting up to `timeout`."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while not self._outputs and time.monotonic() < deadline:
                self._cv.wait(deadline - time.monotonic())
            out, self._outputs = self._outputs, []
            return out

    def generate(self, requests: list[tuple[str, str | None, list[int] | None, SamplingParams]],
                 timeout: float | None = None) -> list[RequestOutput]:
        ids = [r[0] for r in requests]
        events = []
        with self._cv:
            self._check_accepting()
            for rid in ids:
                events.append(self._waiters[rid])
            try:
                for rid, prompt, tok, params in requests:
                    self.engine.add_request(rid, prompt, tok, params)
            except Exception:
                for rid in ids:
                    self.engine.abort_request(rid)
                    self._waiters.pop(rid, None)
                raise
            self._cv.notify_all()
        for ev in events:
            if not ev.wait(timeout):
                raise TimeoutError("generate timed out")
        with self._cv:
            return [self._finished.pop(rid) for rid in ids]

    # ---- control -----------------------------------------------------------------
    def pause(self, mode: str = "wait", timeout: float = 60.0) -> dict:
        """Stop stepping. mode: abort in-flight requests, wait for them, or keep them for resume."""
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"mode must be abort, wait or keep, got {mode!r}")
        deadline = time.monotonic() + timeout
        with self._cv:
            if mode == "wait":
                while self.engine.has_unfinished() and time.monotonic() < deadline:
                    self._cv.wait(0.05)
                if self.engine.has_unfinished():
                    raise TimeoutError(f"in-flight requests did not finish within {timeout}s")
            self._paused = True
            while self._stepping or self.engine.in_flight:  # the loop collects a batch in flight
                self._cv.wait(0.05)
            aborted = []
            if mode == "abort":
                aborted = self.engine.abort_all("aborted: the engine is going to sleep")
                self._publish(self.engine.drain_outputs())
            elif mode == "keep":
                self.engine.preempt_all()  # their KV is about to be released: recompute after wake
        return {"paused": True, "mode": mode, "aborted": len(aborted), "kept": self.engine.num_unfinished()}

    def resume(self) -> None:
        with self._cv:
            self._paused = False
            self._cv.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def stats(self) -> dict:
        s = dict(self.engine.stats())
        s.update(paused=self._paused, steps=self.steps, last_error=self.last_error, handovers=dict(self.handovers))
        return s

    def stop(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    # ---- loop -----------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                engine = self.engine
                while not engine.in_flight and not self._stop and (self._paused or not engine.has_unfinished()):
                    self._cv.wait(0.5)
                if self._stop and not engine.in_flight:
                    return
                launch = not (self._paused or self._stop)  # else only collect the batch in flight
                self._stepping = True
            try:
                outputs = engine.step(launch)
                self.last_error = None
            except Exception as e:  # the engine already failed its running requests
                self.last_error = f"{type(e).__name__}: {e}"
                log.error("step_failed", error=self.last_error)
                outputs = self.engine.drain_outputs()
            with self._cv:
                self._stepping = False
                self.steps += 1
                self._publish(outputs)
                self._cv.notify_all()

    def _publish_from_step(self, outputs: list[RequestOutput]) -> bool:
        """Outputs handed over from inside a step, before a prefill launches (LLMEngine.publish).
        The step holds the engine's lock, and pause() holds _cv while it calls into the engine:
        so wait for _cv only briefly. Refused, the outputs come back with the step as before.
        Not waiting at all lost the hand-over whenever an add or a poll held _cv, which in a burst
        of arrivals is most of the time (run 75: TTFT p50 unchanged by it)."""
        if not self._cv.acquire(timeout=HANDOVER_WAIT_S):
            self.handovers["refused"] += 1
            return False
        self.handovers["taken"] += 1
        try:
            self._publish(outputs)
            self._cv.notify_all()
        finally:
            self._cv.release()
        return True

    def _publish(self, outputs: list[RequestOutput]) -> None:
        self.engine.first_tokens.out(outputs)
        version = self._weight_version()
        for out in outputs:
            out.weight_version = version
            if out.request_id in self._waiters:
                if out.finished:
                    self._finished[out.request_id] = out
                    self._waiters.pop(out.request_id).set()
            else:
                self._outputs.append(out)
