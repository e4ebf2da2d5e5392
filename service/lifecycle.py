"""The lifecycle vocabulary shared by the coordinator, the ranks and their callers: states, errors
(the coordinator's, and a rank's refusal to run), and how each entry point (HTTP or the offline
`LLM`) names the call that gets a model out of a state."""

from __future__ import annotations

from dataclasses import dataclass, field

TAGS = ("weights", "kv_cache")
MODES = ("abort", "wait", "keep")
RUNNING, PAUSED, SLEEPING, WEIGHTS_INVALID, FAILED = "running", "paused", "sleeping", "weights-invalid", "failed"

# What to do next, in the caller's words ("the model is asleep: POST /wake_up first").
HINTS = {
    "http": {"wake_up": "POST /wake_up", "wake_weights": "POST /wake_up?tags=weights",
             "update_weights": "POST /update_weights", "resume": "POST /resume", "restart": "POST /restart",
             "sleep_mode": "start the server with --enable-sleep-mode"},
    "offline": {"wake_up": "call wake_up()", "wake_weights": "call wake_up(tags=['weights'])",
                "update_weights": "call update_weights()", "resume": "call resume()", "restart": "call restart()",
                "sleep_mode": "create the LLM with enable_sleep_mode=True"},
}


class CoordinationError(RuntimeError):
    """A refused or failed transition: `status` is the HTTP answer, `ranks` every rank's outcome."""

    def __init__(self, status: int, message: str, ranks: list[dict] | None = None, retry: bool = False):
        super().__init__(message)
        self.status = status
        self.ranks = ranks
        self.retry = retry

    @property
    def outcomes(self) -> list[dict]:
        """Every rank's outcome (the offline API's name for `ranks`)."""
        return self.ranks or []


class EngineStateError(RuntimeError):
    """A rank cannot run a forward in its current state (asleep, weights discarded, failed)."""


class InvalidArgument(CoordinationError, ValueError):
    """A bad argument (level, mode, tags, weight source): 422 over HTTP, a ValueError offline."""

    def __init__(self, message: str):
        super().__init__(422, message)


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


def fail_status(outcomes: list[dict]) -> int:
    return 504 if any(o.get("timeout") for o in outcomes) else 500


def errors(outcomes: list[dict]) -> str:
    return "; ".join(o["error"] for o in outcomes if not o["ok"])
