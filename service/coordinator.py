"""Lifecycle coordination of one model's TP ranks (DESIGN §3).

One state machine per model: running / paused / sleeping(level, tags asleep) / weights-invalid /
failed. Every transition is serialised, sent to all ranks in parallel with a deadline, and
answered with every rank's outcome. A sleep that fails on some rank is rolled back (the ranks
that did sleep are woken again); a wake is confirmed (all ranks awake, the same tail epochs)
before the engine steps again.

Blocking by design (Ray calls with deadlines): the HTTP controller runs it in threads, the
offline LLM can call it directly. Errors are `CoordinationError`s carrying the HTTP status
that the API answers with.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field

import ray

from .log import get_logger

log = get_logger("coordinator")

TAGS = ("weights", "kv_cache")
MODES = ("abort", "wait", "keep")
RUNNING, PAUSED, SLEEPING, WEIGHTS_INVALID, FAILED = "running", "paused", "sleeping", "weights-invalid", "failed"


class CoordinationError(RuntimeError):
    """A refused or failed transition: `status` is the HTTP answer, `ranks` every rank's outcome."""

    def __init__(self, status: int, message: str, ranks: list[dict] | None = None, retry: bool = False):
        super().__init__(message)
        self.status = status
        self.ranks = ranks
        self.retry = retry


@dataclass
class LifecycleState:
    user_paused: bool = False
    sleep_level: int | None = None  # None: not sleeping (level 0 sleeps with nothing asleep)
    asleep: list[set[str]] = field(default_factory=list)  # per rank
    weights_valid: bool = True
    weights_note: str = "level-2 sleep discarded the weights"  # why they are invalid, when they are
    failed: str | None = None
    busy: str | None = None  # the transition in progress
    weight_version: int = 0

    @property
    def name(self) -> str:
        if self.failed:
            return FAILED
        if self.sleep_level is not None:
            return SLEEPING
        if not self.weights_valid:
            return WEIGHTS_INVALID
        return PAUSED if self.user_paused else RUNNING

    @property
    def tags_asleep(self) -> list[str]:
        return sorted(set().union(*self.asleep)) if self.asleep else []


# ---- parallel rank calls ----------------------------------------------------------------
def call_ranks(actors: list, method: str, args_per_rank: list[tuple | None], timeout: float):
    """Call `method` on each rank whose args are not None, in parallel, with one deadline.

    Returns (outcomes, pending): one outcome per rank ({rank, ok, result | error, timeout?, dead?,
    skipped?}) and {rank: ref} for calls still running at the deadline (a rollback waits for them).
    """
    refs = {r: getattr(a, method).remote(*args) for r, (a, args) in enumerate(zip(actors, args_per_rank))
            if args is not None}
    done, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout) if refs else ([], [])
    done = set(done)
    outcomes, pending = [], {}
    for rank in range(len(actors)):
        if rank not in refs:
            outcomes.append({"rank": rank, "ok": True, "skipped": True, "result": None})
        elif refs[rank] not in done:
            pending[rank] = refs[rank]
            outcomes.append({"rank": rank, "ok": False, "timeout": True,
                             "error": f"rank {rank} missed the {timeout:g}s deadline for {method}"})
        else:
            outcomes.append(_outcome(rank, refs[rank]))
    return outcomes, pending


def _outcome(rank: int, ref) -> dict:
    try:
        return {"rank": rank, "ok": True, "result": ray.get(ref, timeout=0)}
    except ray.exceptions.RayActorError as e:
        return {"rank": rank, "ok": False, "dead": True, "error": f"rank {rank} actor died: {_first_line(e)}"}
    except Exception as e:
        return {"rank": rank, "ok": False, "error": error_text(e)}


def error_text(e: BaseException) -> str:
    """The innermost message of a Ray task failure, without Ray's traceback framing."""
    cause = getattr(e, "cause", None)
    if cause is not None and not isinstance(cause, ray.exceptions.RayError):
        return f"{type(cause).__name__}: {cause}"
    return f"{type(e).__name__}: {_first_line(e)}"


def _first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else ""


def _fail_status(outcomes: list[dict]) -> int:
    return 504 if any(o.get("timeout") for o in outcomes) else 500


def _errors(outcomes: list[dict]) -> str:
    return "; ".join(o["error"] for o in outcomes if not o["ok"])


# ---- the state machine ----------------------------------------------------------------
class Coordinator:
    """Transitions of one model. `executor` needs `.actors` and `.rank0` (a RayExecutor)."""

    def __init__(self, executor, *, sleep_enabled: bool, deadline_s: float | None = None,
                 on_change: Callable[[LifecycleState], None] | None = None):
        self.executor = executor
        self.sleep_enabled = sleep_enabled
        self.deadline_s = deadline_s or float(os.environ.get("LATENTSERVE_RANK_DEADLINE_S", "120"))
        self.state = LifecycleState(asleep=[set() for _ in executor.actors])
        self._transition = threading.Lock()
        self._engine_paused = False
        self._on_change = on_change
        # Weight transports by the update body's key; other sources register theirs here.
        self.weight_sources: dict[str, Callable[[object, int, float], list[dict]]] = {"path": self._load_path}
        self.last_weights: dict | None = None  # the last update's source and version
        # Called inside a successful update's transition (engine still paused) with (kind, source,
        # version, timeout); what it returns goes into the answer (weight_restore.RestorePlan).
        self.on_weights_updated: Callable[[str, object, int, float], dict] | None = None

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
        s = self.state
        if s.failed:
            raise CoordinationError(503, f"the model failed and needs POST /restart: {s.failed}")
        if s.busy in ("sleep", "restart", "update_weights"):
            raise CoordinationError(503, f"a {s.busy} is in progress; retry shortly", retry=True)
        if s.sleep_level is not None:
            asleep = ", ".join(s.tags_asleep) or "nothing released, engine paused"
            raise CoordinationError(503, f"the model is asleep (level {s.sleep_level}; asleep: {asleep}): "
                                         "POST /wake_up first")
        if not s.weights_valid:
            raise CoordinationError(409, f"{s.weights_note}: POST /update_weights with new weights "
                                         "before generating")
        if s.user_paused:
            raise CoordinationError(503, "generation is paused: POST /resume")

    # ---- transitions -----------------------------------------------------------------
    @contextmanager
    def _guard(self, op: str, wait_s: float = 5.0):
        if not self._transition.acquire(timeout=wait_s):
            raise CoordinationError(409, f"cannot {op}: a {self.state.busy} is in progress", retry=True)
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
            raise CoordinationError(503, f"the model failed and needs POST /restart: {self.state.failed}")

    def sleep(self, level: int = 1, mode: str = "abort", timeout: float | None = None) -> dict:
        if level not in (0, 1, 2):
            raise CoordinationError(422, f"sleep level must be 0, 1 or 2, got {level}")
        if mode not in MODES:
            raise CoordinationError(422, f"sleep mode must be one of {MODES}, got {mode!r}")
        if level > 0 and not self.sleep_enabled:
            raise CoordinationError(409, "sleep mode is off: start the server with --enable-sleep-mode")
        timeout = timeout or self.deadline_s
        with self._guard("sleep"):
            self._require_alive()
            if self.state.sleep_level is not None:
                raise CoordinationError(409, f"already asleep at level {self.state.sleep_level}: "
                                             "POST /wake_up first")
            t0 = time.perf_counter()
            paused = self._pause_engine(mode, timeout)
            outcomes, pending = call_ranks(self.executor.actors, "sleep", [(level,)] * len(self.executor.actors),
                                           timeout)
            if not all(o["ok"] for o in outcomes):
                rollback = self._roll_back_sleep(pending, self.deadline_s)  # not the caller's (maybe tiny) timeout
                for o in outcomes:
                    o["rolled_back"] = rollback.get(o["rank"])
                self._settle()
                msg = f"sleep(level={level}) failed: {_errors(outcomes)}; ranks that slept were woken again"
                log.error("sleep_failed", level=level, error=_errors(outcomes))
                raise CoordinationError(_fail_status(outcomes), msg, outcomes)
            reports = [o["result"] for o in outcomes]
            self.state.sleep_level = level
            self._absorb(reports)
            seconds = time.perf_counter() - t0
            log.info("sleep", level=level, mode=mode, seconds=round(seconds, 3), asleep=self.state.tags_asleep)
            return {"level": level, "mode": mode, "engine": paused, "ranks": outcomes,
                    "seconds": seconds, **self.snapshot()}

    def _roll_back_sleep(self, pending: dict, timeout: float) -> dict[int, str]:
        """Wake every rank that is asleep now (late ranks included); mark failed if that fails."""
        if pending:
            ray.wait(list(pending.values()), num_returns=len(pending), timeout=timeout)
        n = len(self.executor.actors)
        status, _ = call_ranks(self.executor.actors, "collective_rpc", [("status",)] * n, timeout)
        asleep = [o["result"]["asleep"] if o["ok"] else [] for o in status]
        woke, _ = call_ranks(self.executor.actors, "wake_up", [(a,) if a else None for a in asleep], timeout)
        result, bad = {}, []
        for s, w in zip(status, woke):
            rank = s["rank"]
            if s["ok"] and w["ok"]:
                result[rank] = "was awake" if w.get("skipped") else "woken"
                self.state.asleep[rank] = set()
            else:
                result[rank] = "rollback failed: " + (w.get("error") or s.get("error") or "")
                bad.append(f"rank {rank}: {result[rank]}")
        self._absorb([w["result"] for w in woke if w["ok"] and not w.get("skipped")])
        if bad:
            self.state.failed = "sleep rollback failed (" + "; ".join(bad) + ")"
        return result

    def wake_up(self, tags: list[str] | None = None, timeout: float | None = None) -> dict:
        tags = list(dict.fromkeys(tags)) if tags else list(TAGS)
        bad = [t for t in tags if t not in TAGS]
        if bad:
            raise CoordinationError(422, f"unknown wake_up tags {bad}; known: {list(TAGS)}")
        timeout = timeout or self.deadline_s
        with self._guard("wake_up"):
            self._require_alive()
            s = self.state
            if s.sleep_level is None:
                return {"woken": [], "note": "not asleep", "ranks": [], "seconds": 0.0, **self.snapshot()}
            t0 = time.perf_counter()
            args = [((sorted(set(tags) & a),) if set(tags) & a else None) for a in s.asleep]
            outcomes, _ = call_ranks(self.executor.actors, "wake_up", args, timeout)
            self._absorb([o["result"] for o in outcomes if o["ok"] and not o.get("skipped")])
            if not all(o["ok"] for o in outcomes):
                # No rollback: sleeping again could discard what a level-2 wake restored. The
                # ranks stay asleep in the state machine and a retried wake finishes the job.
                log.error("wake_failed", tags=tags, error=_errors(outcomes))
                raise CoordinationError(_fail_status(outcomes), f"wake_up({tags}) failed: {_errors(outcomes)}; "
                                        "retry wake_up, or POST /restart", outcomes)
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
        outcomes, _ = call_ranks(self.executor.actors, "collective_rpc",
                                 [("status",)] * len(self.executor.actors), timeout)
        if not all(o["ok"] for o in outcomes):
            raise CoordinationError(_fail_status(outcomes), f"wake not confirmed: {_errors(outcomes)}", outcomes)
        reports = [o["result"] for o in outcomes]
        still = [r["rank"] for r in reports if r["asleep"]]
        epochs = {repr(r.get("tail_epochs")) for r in reports}
        if still:
            raise CoordinationError(500, f"wake not confirmed: ranks {still} still report tags asleep", outcomes)
        if len(epochs) > 1:
            self.state.failed = f"ranks disagree on tail epochs after wake: {sorted(epochs)}"
            raise CoordinationError(500, self.state.failed + "; POST /restart", outcomes)
        self.state.weights_valid = all(r["weights_valid"] for r in reports)
        return reports[0].get("tail_epochs")

    def pause(self, mode: str = "keep", timeout: float | None = None) -> dict:
        if mode not in MODES:
            raise CoordinationError(422, f"pause mode must be one of {MODES}, got {mode!r}")
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
                raise CoordinationError(409, "the model is asleep: POST /wake_up instead")
            if not self.state.weights_valid:
                raise CoordinationError(409, f"{self.state.weights_note}: POST /update_weights first")
            self.state.user_paused = False
            self._settle()
            return self.snapshot()

    def update_weights(self, source: dict, timeout: float | None = None) -> dict:
        keys = list(source)
        if len(keys) != 1 or keys[0] not in self.weight_sources:
            known = ", ".join(sorted(self.weight_sources))
            raise CoordinationError(422, f"the body needs exactly one weight source key ({known}); "
                                         f"got {sorted(source) or 'none'}")
        kind = keys[0]
        timeout = timeout or self.deadline_s
        with self._guard("update_weights"):
            self._require_alive()
            s = self.state
            if any("weights" in a for a in s.asleep):
                raise CoordinationError(409, "the weights are asleep: POST /wake_up?tags=weights before "
                                             "update_weights")
            t0 = time.perf_counter()
            if not self._engine_paused:
                self._pause_engine("wait", timeout)
            version = s.weight_version + 1
            try:
                outcomes = self.weight_sources[kind](source[kind], version, timeout)
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
                status = 400 if rejected else _fail_status(outcomes)
                raise CoordinationError(status, f"update_weights({kind}) failed: {_errors(outcomes)}"
                                        + ("" if changed else "; no weights changed"), outcomes)
            s.weight_version = version
            results = [o["result"] for o in outcomes if isinstance(o.get("result"), dict)]
            missing = max((r.get("missing_weights", 0) for r in results), default=0)
            s.weights_valid = all(r.get("weights_valid", True) for r in results)
            if not s.weights_valid:
                s.weights_note = (f"level-2 sleep discarded weights this update did not include "
                                  f"({missing} still missing)")
            self.last_weights = {kind: source[kind], "version": version}
            restart = None
            if self.on_weights_updated is not None:
                try:
                    restart = self.on_weights_updated(kind, source[kind], version, timeout)
                except Exception as e:  # the update itself succeeded: say so, and what a restart loses
                    restart = {"error": f"{type(e).__name__}: {e}"}
            self._settle()
            seconds = time.perf_counter() - t0
            log.info("update_weights", source=kind, version=version, seconds=round(seconds, 3))
            return {"weight_version": version, "source": kind, "ranks": outcomes, "seconds": seconds,
                    "restart": restart, **self.snapshot()}

    def _load_path(self, path, version: int, timeout: float) -> list[dict]:
        if not isinstance(path, str) or not os.path.isdir(path):
            raise CoordinationError(400, f"weights path {path!r} is not a directory on the server")
        outcomes, _ = call_ranks(self.executor.actors, "update_weights_from_path",
                                 [(path, version)] * len(self.executor.actors), timeout)
        return outcomes

    # ---- failures and restart ------------------------------------------------------
    def mark_failed(self, reason: str) -> None:
        if not self.state.failed:
            self.state.failed = reason
            log.error("model_failed", reason=reason)
            self._changed()

    def reset(self, executor, weight_version: int) -> None:
        """After a restart: fresh ranks, awake and running with the given weights."""
        self.executor = executor
        keep = self.last_weights
        self.state = LifecycleState(asleep=[set() for _ in executor.actors], weight_version=weight_version)
        self.last_weights = keep
        self._engine_paused = False
        self._changed()

    @contextmanager
    def restarting(self):
        with self._guard("restart", wait_s=self.deadline_s):
            yield

    # ---- engine pause/resume on rank 0 ----------------------------------------------
    def _pause_engine(self, mode: str, timeout: float) -> dict:
        # An engine already paused can't drain ("wait" would time out): keep its requests instead.
        if self._engine_paused and mode == "wait":
            mode = "keep"
        ref = self.executor.rank0.pause.remote(mode, timeout)
        try:
            report = ray.get(ref, timeout=timeout + 5)
        except ray.exceptions.GetTimeoutError as e:
            raise CoordinationError(504, f"pausing the engine (mode={mode}) missed the {timeout:g}s deadline") from e
        except Exception as e:
            text = error_text(e)
            status = 504 if "TimeoutError" in text else 500
            raise CoordinationError(status, f"pausing the engine (mode={mode}) failed: {text}") from e
        self._engine_paused = True
        return report

    def _settle(self) -> None:
        """Let the engine step again when nothing stands in the way."""
        s = self.state
        runnable = not s.failed and s.sleep_level is None and s.weights_valid and not s.user_paused \
            and not s.tags_asleep
        if runnable and self._engine_paused:
            try:
                ray.get(self.executor.rank0.resume.remote(), timeout=self.deadline_s)
                self._engine_paused = False
            except Exception as e:
                self.mark_failed(f"rank 0 did not resume: {error_text(e)}")

    def _absorb(self, reports: list[dict]) -> None:
        for r in reports:
            self.state.asleep[r["rank"]] = set(r.get("asleep", ()))
        if reports and any(not r.get("weights_valid", True) for r in reports):
            self.state.weights_valid = False
            self.state.weights_note = "level-2 sleep discarded the weights"
