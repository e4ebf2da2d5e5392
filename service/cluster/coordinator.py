"""Lifecycle coordination of one model's TP ranks: the one path every entry point takes.

The offline `LLM` and the HTTP controller both drive the ranks through a `Coordinator`, over the
executor interface (executor.Executor: `ray`, `mp` or `uni`), for sleep, wake, weight
updates, pause/resume and restart. One state machine per model: running / paused /
sleeping(level, tags asleep) / weights-invalid / failed. Every transition is serialised (a
second one arriving meanwhile is refused with 409 at once, nothing queues), sent to all ranks
in parallel with a deadline, and answered with every rank's outcome. A sleep that fails on some
rank is rolled back (the ranks that did sleep are woken again, so no rank is left asleep); a
wake is confirmed (all ranks awake, the same tail epochs) before the engine steps again.

Blocking by design: the HTTP controller runs it in threads, the offline LLM calls it directly.
Errors are `CoordinationError`s carrying the HTTP status the API answers with.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager

from ..lifecycle import (
    HINTS,
    MODES,
    TAGS,
    CoordinationError,
    InvalidArgument,
    LifecycleState,
    errors,
    fail_status,
)
from ..log import get_logger
from ..weights.restore import RestorePlan

log = get_logger("coordinator")

# A weight source: (executor, the body's value, version, timeout) -> one outcome per rank.
WeightSource = Callable[[object, object, int, float], list[dict]]


class Coordinator:
    """Transitions of one model's ranks. `hints` names the follow-up calls in errors ('http' or
    'offline'); `weight_snapshot` is what a restart keeps of tensor updates (weights/restore.py)."""

    def __init__(self, executor, *, sleep_enabled: bool, deadline_s: float | None = None,
                 on_change: Callable[[LifecycleState], None] | None = None, hints: str = "http",
                 weight_snapshot: str = "off"):
        self.executor = executor
        self.sleep_enabled = sleep_enabled
        self.deadline_s = deadline_s or float(os.environ.get("LATENTSERVE_RANK_DEADLINE_S", "120"))
        self.state = LifecycleState(asleep=[set() for _ in range(executor.world_size)])
        self.hint = HINTS[hints]
        self._transition = threading.Lock()
        self._engine_paused = False
        self._on_change = on_change
        # Weight transports by the update body's key; other sources register theirs here.
        self.weight_sources: dict[str, WeightSource] = {"path": load_path}
        self.last_weights: dict | None = None  # the last update's source kind and version
        self.restore = RestorePlan(weight_snapshot)  # what a restart brings back

    # ---- queries -----------------------------------------------------------------
    def snapshot(self) -> dict:
        s = self.state
        return {"state": s.name, "sleep_level": s.sleep_level, "tags_asleep": s.tags_asleep,
                "weights_valid": s.weights_valid, "weight_version": s.weight_version, "paused": s.user_paused,
                "failed": s.failed, "busy": s.busy}

    def is_sleeping(self) -> dict:
        s = self.state
        return {"is_sleeping": s.sleep_level is not None, "level": s.sleep_level, "tags_asleep": s.tags_asleep}

    def check_generation(self) -> None:
        """Raise unless a new request may enter the engine now."""
        s, h = self.state, self.hint
        if s.failed:
            raise CoordinationError(503, f"the model failed and needs {h['restart']}: {s.failed}")
        if s.busy in ("sleep", "restart", "update_weights"):
            raise CoordinationError(503, f"a {s.busy} is in progress; retry shortly", retry=True)
        if s.sleep_level is not None:
            asleep = ", ".join(s.tags_asleep) or "nothing released, engine paused"
            raise CoordinationError(503, f"the model is asleep (level {s.sleep_level}; asleep: {asleep}): "
                                         f"{h['wake_up']} first")
        if not s.weights_valid:
            raise CoordinationError(409, f"{s.weights_note}: {h['update_weights']} with new weights "
                                         "before generating")
        if s.user_paused:
            raise CoordinationError(503, f"generation is paused: {h['resume']}")

    # ---- serialisation -----------------------------------------------------------------
    @contextmanager
    def _guard(self, op: str, wait_s: float = 0.0):
        """One transition at a time. Another one arriving meanwhile gets 409 at once (the caller
        may retry): concurrent sleeps and wakes never interleave on the ranks, and the one that
        went first decides the state the others see."""
        got = self._transition.acquire(timeout=wait_s) if wait_s > 0 else self._transition.acquire(blocking=False)
        if not got:
            raise CoordinationError(409, f"cannot {op}: a {self.state.busy or 'transition'} is in progress",
                                    retry=True)
        self.state.busy = op
        try:
            yield
        finally:
            self.state.busy = None
            self._transition.release()
            self._changed()

    def _changed(self) -> None:
        if self._on_change is not None:
            self._on_change(self.state)

    def _require_alive(self) -> None:
        if self.state.failed:
            raise CoordinationError(503, f"the model failed and needs {self.hint['restart']}: {self.state.failed}")

    def _call(self, method: str, args_per_rank: list, timeout: float):
        return self.executor.call_ranks(method, args_per_rank, timeout)

    def _all(self, *args) -> list:
        return [args] * self.executor.world_size

    # ---- sleep and wake -----------------------------------------------------------------
    def sleep(self, level: int = 1, mode: str = "abort", timeout: float | None = None, *,
              again: bool = False) -> dict:
        """Every rank to `level`. `again`: asleep already is no error (the ranks report what they
        still had awake put to sleep, or a no-op); else 409."""
        if level not in (0, 1, 2):
            raise InvalidArgument(f"sleep level must be 0, 1 or 2, got {level}")
        if mode not in MODES:
            raise InvalidArgument(f"sleep mode must be one of {MODES}, got {mode!r}")
        if level > 0 and not self.sleep_enabled:
            raise CoordinationError(409, f"sleep mode is off: {self.hint['sleep_mode']}")
        timeout = timeout or self.deadline_s
        with self._guard("sleep"):
            self._require_alive()
            s = self.state
            if s.sleep_level is not None and not again:
                raise CoordinationError(409, f"already asleep at level {s.sleep_level}: {self.hint['wake_up']} first")
            t0 = time.perf_counter()
            before = [set(a) for a in s.asleep]
            paused = self._pause_engine(mode, timeout)
            outcomes, pending = self._call("sleep", self._all(level), timeout)
            if not all(o["ok"] for o in outcomes):
                # Never half asleep: back to what every rank had asleep before (the caller's
                # possibly tiny timeout is not the rollback's).
                rollback, ok = self._roll_back_sleep(pending, before, self.deadline_s)
                for o in outcomes:
                    o["rolled_back"] = rollback.get(o["rank"])
                self._settle()
                where = "every rank is awake" if not any(before) else "every rank is as before"
                state = f"rolled back: {where}" if ok else f"the rollback failed on some ranks: {self.hint['restart']}"
                log.error("sleep_failed", level=level, error=errors(outcomes), rolled_back=ok)
                raise CoordinationError(fail_status(outcomes), f"sleep(level={level}) failed ({state}): "
                                        f"{errors(outcomes)}", outcomes)
            s.sleep_level = level if s.sleep_level is None else max(s.sleep_level, level)
            self._absorb([o["result"] for o in outcomes])
            seconds = time.perf_counter() - t0
            log.info("sleep", level=level, mode=mode, seconds=round(seconds, 3), asleep=s.tags_asleep)
            return {"level": level, "mode": mode, "engine": paused, "ranks": outcomes,
                    "seconds": seconds, **self.snapshot()}

    def _roll_back_sleep(self, pending: dict, before: list[set[str]], timeout: float) -> tuple[dict[int, str], bool]:
        """Wake on every rank what is asleep now and was not before the sleep (late ranks
        included); mark the model failed if that fails."""
        if pending:
            cf.wait(list(pending.values()), timeout=timeout)
        status, _ = self._call("collective_rpc", self._all("status"), timeout)
        extra = [sorted(set(o["result"]["asleep"]) - before[o["rank"]]) if o["ok"] else [] for o in status]
        woke, _ = self._call("wake_up", [(t,) if t else None for t in extra], timeout)
        result, bad = {}, []
        for s, w in zip(status, woke):
            rank = s["rank"]
            if s["ok"] and w["ok"]:
                result[rank] = "was awake" if w.get("skipped") else "woken"
                self.state.asleep[rank] = set(before[rank])
            else:
                result[rank] = "rollback failed: " + (w.get("error") or s.get("error") or "")
                bad.append(f"rank {rank}: {result[rank]}")
        self._absorb([w["result"] for w in woke if w["ok"] and not w.get("skipped")])
        if bad:
            self.state.failed = "sleep rollback failed (" + "; ".join(bad) + ")"
        return result, not bad

    def wake_up(self, tags: list[str] | None = None, timeout: float | None = None) -> dict:
        """Wake `tags` (default all) on every rank; each rank reports (a no-op where awake)."""
        tags = list(dict.fromkeys(tags)) if tags else list(TAGS)
        bad = [t for t in tags if t not in TAGS]
        if bad:
            raise InvalidArgument(f"unknown wake_up tags {bad}; known: {list(TAGS)}")
        timeout = timeout or self.deadline_s
        with self._guard("wake_up"):
            self._require_alive()
            s = self.state
            t0 = time.perf_counter()
            outcomes, _ = self._call("wake_up", self._all(tags), timeout)
            self._absorb([o["result"] for o in outcomes if o["ok"]])
            if not all(o["ok"] for o in outcomes):
                # No rollback: sleeping again could discard what a level-2 wake restored. The
                # ranks stay asleep in the state machine and a retried wake finishes the job.
                log.error("wake_failed", tags=tags, error=errors(outcomes))
                raise CoordinationError(fail_status(outcomes), f"wake_up({tags}) failed: {errors(outcomes)}; "
                                        f"retry wake_up, or {self.hint['restart']}", outcomes)
            if s.sleep_level is None and not s.tags_asleep:
                return {"woken": [], "note": "not asleep", "ranks": outcomes, "seconds": 0.0, **self.snapshot()}
            epochs = None
            if not s.tags_asleep:
                epochs = self._confirm_wake(timeout)
                s.sleep_level = None
                self._settle()
            seconds = time.perf_counter() - t0
            log.info("wake_up", tags=tags, seconds=round(seconds, 3), asleep=s.tags_asleep, state=s.name)
            return {"woken": tags, "ranks": outcomes, "tail_epochs": epochs, "seconds": seconds,
                    **self.snapshot()}

    def _confirm_wake(self, timeout: float):
        """All ranks awake with the same tail epochs, or the model is failed (Lamport state diverged)."""
        outcomes, _ = self._call("collective_rpc", self._all("status"), timeout)
        if not all(o["ok"] for o in outcomes):
            raise CoordinationError(fail_status(outcomes), f"wake not confirmed: {errors(outcomes)}", outcomes)
        reports = [o["result"] for o in outcomes]
        still = [r["rank"] for r in reports if r["asleep"]]
        epochs = {repr(r.get("tail_epochs")) for r in reports}
        if still:
            raise CoordinationError(500, f"wake not confirmed: ranks {still} still report tags asleep", outcomes)
        if len(epochs) > 1:
            self.state.failed = f"ranks disagree on tail epochs after wake: {sorted(epochs)}"
            raise CoordinationError(500, f"{self.state.failed}; {self.hint['restart']}", outcomes)
        self.state.weights_valid = all(r["weights_valid"] for r in reports)
        return reports[0].get("tail_epochs")

    # ---- pause and resume -----------------------------------------------------------------
    def pause(self, mode: str = "keep", timeout: float | None = None) -> dict:
        if mode not in MODES:
            raise InvalidArgument(f"pause mode must be one of {MODES}, got {mode!r}")
        with self._guard("pause"):
            self._require_alive()
            if self.state.sleep_level is not None:
                raise CoordinationError(409, "the model is asleep: nothing to pause")
            report = self._pause_engine(mode, timeout or self.deadline_s)
            self.state.user_paused = True
            return {"engine": report, **self.snapshot()}

    def resume(self) -> dict:
        with self._guard("resume"):
            self._require_alive()
            if self.state.sleep_level is not None:
                raise CoordinationError(409, f"the model is asleep: {self.hint['wake_up']} instead")
            if not self.state.weights_valid:
                raise CoordinationError(409, f"{self.state.weights_note}: {self.hint['update_weights']} first")
            self.state.user_paused = False
            self._settle()
            return self.snapshot()

    # ---- weights -----------------------------------------------------------------
    def update_weights(self, source: dict, timeout: float | None = None) -> dict:
        """`source` has one key, a registered weight source (path, group, refs; tensors offline)."""
        keys = list(source)
        if len(keys) != 1 or keys[0] not in self.weight_sources:
            known = ", ".join(sorted(self.weight_sources))
            raise InvalidArgument(f"the body needs exactly one weight source key ({known}); "
                                  f"got {sorted(source) or 'none'}")
        kind = keys[0]
        timeout = timeout or self.deadline_s
        with self._guard("update_weights"):
            self._require_alive()
            s = self.state
            if any("weights" in a for a in s.asleep):
                raise CoordinationError(409, f"the weights are asleep: {self.hint['wake_weights']} before "
                                             "update_weights")
            t0 = time.perf_counter()
            if not self._engine_paused:
                self._pause_engine("wait", timeout)
            version = s.weight_version + 1
            try:
                outcomes = self.weight_sources[kind](self.executor, source[kind], version, timeout)
            except CoordinationError:  # rejected before any rank changed: serve on
                self._settle()
                raise
            if not all(o["ok"] for o in outcomes):
                changed = any(o["ok"] for o in outcomes)
                if changed:  # some ranks hold the new weights, some the old: not servable
                    s.weights_valid = False
                    s.weights_note = "a weight update failed on some ranks, which now disagree"
                self._settle()
                rejected = not changed and not any(o.get("timeout") or o.get("dead") for o in outcomes)
                status = 400 if rejected else fail_status(outcomes)
                raise CoordinationError(status, f"update_weights({kind}) failed: {errors(outcomes)}"
                                        + ("" if changed else "; no weights changed"), outcomes)
            s.weight_version = version
            results = [o["result"] for o in outcomes if isinstance(o.get("result"), dict)]
            missing = max((r.get("missing_weights", 0) for r in results), default=0)
            s.weights_valid = all(r.get("weights_valid", True) for r in results)
            if not s.weights_valid:
                s.weights_note = (f"level-2 sleep discarded weights this update did not include "
                                  f"({missing} still missing)")
            self.last_weights = {"source": kind, "version": version}
            try:  # inside the transition: the engine is still paused, the weights are what was sent
                restart = self.restore.updated(kind, source[kind], version, self.executor, timeout)
            except Exception as e:  # the update itself succeeded: say so, and what a restart loses
                restart = {"error": f"{type(e).__name__}: {e}"}
            self._settle()
            seconds = time.perf_counter() - t0
            log.info("update_weights", source=kind, version=version, seconds=round(seconds, 3))
            return {"weight_version": version, "source": kind, "ranks": outcomes, "seconds": seconds,
                    "restart": restart, **self.snapshot()}

    # ---- failures and restart ------------------------------------------------------
    def mark_failed(self, reason: str) -> None:
        if not self.state.failed:
            self.state.failed = reason
            log.error("model_failed", reason=reason)
            self._changed()

    def restart(self, make_executor: Callable[[], object]) -> dict:
        """Fresh ranks with the served weights and version (RestorePlan: the last path checkpoint,
        then the snapshot overlay): the old ranks are stopped (killed if some do not answer)."""
        t0 = time.perf_counter()
        with self._guard("restart", wait_s=self.deadline_s):
            try:
                self.executor.teardown()
            except Exception as e:  # what is left of them goes with the process
                log.error("teardown_failed", error=f"{type(e).__name__}: {e}")
            try:
                self.executor = make_executor()
                version, restored = self.restore.restore(self.executor, self.deadline_s)
            except Exception as e:
                self.state.failed = f"restart failed: {type(e).__name__}: {e}"
                status = e.status if isinstance(e, CoordinationError) else 500
                raise CoordinationError(status, f"{self.state.failed}; {self.hint['restart']} again",
                                        getattr(e, "ranks", None)) from e
            self.state = LifecycleState(asleep=[set() for _ in range(self.executor.world_size)],
                                        weight_version=version, busy="restart")
            self._engine_paused = False
        seconds = time.perf_counter() - t0
        log.info("restarted", seconds=round(seconds, 2), weight_version=version)
        note = f"lost: {restored['lost']}; restored {restored['from']}" if restored["lost"] else None
        return {"restarted": True, "seconds": seconds, "weights_reloaded_from": restored["path"],
                "restored": restored, "note": note, **self.snapshot()}

    # ---- engine pause/resume on rank 0 ----------------------------------------------
    def _pause_engine(self, mode: str, timeout: float) -> dict:
        # An engine already paused can't drain ("wait" would time out): keep its requests instead.
        if self._engine_paused and mode == "wait":
            mode = "keep"
        fut = self.executor.submit(0, "pause", mode, timeout)
        try:
            report = fut.result(timeout + 5)
        except Exception as e:
            if not fut.done():
                raise CoordinationError(504, f"pausing the engine (mode={mode}) missed the {timeout:g}s "
                                             "deadline") from e
            status = 504 if isinstance(e, TimeoutError) else 500
            raise CoordinationError(status, f"pausing the engine (mode={mode}) failed: "
                                            f"{self.executor.error_text(e)}") from e
        self._engine_paused = True
        return report

    def _settle(self) -> None:
        """Let the engine step again when nothing stands in the way."""
        s = self.state
        runnable = not s.failed and s.sleep_level is None and s.weights_valid and not s.user_paused \
            and not s.tags_asleep
        if runnable and self._engine_paused:
            try:
                self.executor.rank0_call("resume", timeout=self.deadline_s)
                self._engine_paused = False
            except Exception as e:
                self.mark_failed(f"rank 0 did not resume: {self.executor.error_text(e)}")

    def _absorb(self, reports: list[dict]) -> None:
        for r in reports:
            self.state.asleep[r["rank"]] = set(r.get("asleep", ()))
        if reports and any(not r.get("weights_valid", True) for r in reports):
            self.state.weights_valid = False
            self.state.weights_note = "level-2 sleep discarded the weights"


# ---- weight sources every entry point has ----------------------------------------------
def load_path(executor, path, version: int, timeout: float) -> list[dict]:
    """`{"path": DIR}`: every rank loads its slices of a checkpoint directory."""
    if not isinstance(path, str) or not os.path.isdir(path):
        raise CoordinationError(400, f"weights path {path!r} is not a directory on the server")
    return executor.call_ranks("update_weights_from_path", [(path, version)] * executor.world_size, timeout)[0]


def load_tensors(executor, named_tensors, version: int, timeout: float) -> list[dict]:
    """`{"tensors": [(name, tensor), ...]}` (the offline API): full HF-named tensors, each rank
    keeps its slices; handed over once (Ray: one object in the store for all ranks)."""
    handle = executor.put(list(named_tensors))
    return executor.call_ranks("update_weights_from_tensors", [(handle, version)] * executor.world_size,
                               timeout)[0]
