"""The executor interface: what the coordinator, the offline `LLM` and the HTTP controller need
of a model's TP ranks, whatever runs them (`ray`: an actor per rank, `mp`: a process per rank,
`uni`: TP 1 in this process).

An executor implements `submit` (one call on one rank, answered by a `Future`) and says which
failures mean a dead rank; everything else (all-rank calls with one deadline and one outcome
dict per rank, rank 0 calls, teardown) is derived here, the same for every backend
(`backends.make_executor` picks one by name).
"""

from __future__ import annotations

import concurrent.futures as cf
from concurrent.futures import Future

from ..engine_config import EngineConfig


class RankGone(RuntimeError):
    """The rank's process or actor is gone (an executor raises it, or its own kind of it)."""


def first_line(e: BaseException) -> str:
    s = str(e).strip()
    return s.splitlines()[0] if s else ""


class Executor:
    """A model's TP ranks. Subclasses set `config`, `nodes`, `same_node`, `rank0` and implement
    `submit`, `shutdown` and `kill` (and `is_dead`/`error_text` where their failures differ)."""

    config: EngineConfig
    nodes: list[str]
    same_node: bool = True

    @property
    def world_size(self) -> int:
        return self.config.tensor_parallel_size

    # ---- what a backend provides --------------------------------------------------
    def submit(self, rank: int, method: str, *args, **kwargs) -> Future:
        """Call `method` on rank `rank` without waiting; exceptions arrive on the future."""
        raise NotImplementedError

    def shutdown(self) -> None:
        """Stop the ranks gracefully (rank 0's engine loop first, then the followers)."""
        raise NotImplementedError

    def kill(self) -> None:
        """Stop the ranks at once (a collective with a dead peer could block a graceful stop)."""
        raise NotImplementedError

    def is_dead(self, e: BaseException) -> bool:
        return isinstance(e, RankGone)

    def error_text(self, e: BaseException) -> str:
        return f"{type(e).__name__}: {first_line(e)}"

    def put(self, value):
        """A handle every rank can take as an argument (Ray: the object store; else the value)."""
        return value

    # ---- derived: the same for every backend -----------------------------------------
    def call_ranks(self, method: str, args_per_rank: list[tuple | None], timeout: float,
                   kwargs: dict | None = None) -> tuple[list[dict], dict[int, Future]]:
        """Call `method` on each rank whose args are not None, in parallel, with one deadline.

        Returns (outcomes, pending): one outcome per rank ({rank, ok, result | error, timeout?,
        dead?, skipped?}) and {rank: future} for calls still running at the deadline (a rollback
        waits for them). Never raises for a rank's failure.
        """
        futures: dict[int, Future] = {}
        early: dict[int, dict] = {}
        for rank, args in enumerate(args_per_rank):
            if args is None:
                continue
            try:
                futures[rank] = self.submit(rank, method, *args, **(kwargs or {}))
            except Exception as e:  # the call could not even be sent (a dead process, a closed pipe)
                early[rank] = self._failure(rank, e)
        if futures:
            cf.wait(list(futures.values()), timeout=timeout)
        outcomes, pending = [], {}
        for rank in range(len(args_per_rank)):
            if rank in early:
                outcomes.append(early[rank])
            elif rank not in futures:
                outcomes.append({"rank": rank, "ok": True, "skipped": True, "result": None})
            elif not futures[rank].done():
                pending[rank] = futures[rank]
                outcomes.append({"rank": rank, "ok": False, "timeout": True,
                                 "error": f"rank {rank} missed the {timeout:g}s deadline for {method}"})
            elif futures[rank].exception() is not None:
                outcomes.append(self._failure(rank, futures[rank].exception()))
            else:
                outcomes.append({"rank": rank, "ok": True, "result": futures[rank].result()})
        return outcomes, pending

    def _failure(self, rank: int, e: BaseException) -> dict:
        if self.is_dead(e):
            return {"rank": rank, "ok": False, "dead": True, "error": f"rank {rank} actor died: {first_line(e)}"}
        return {"rank": rank, "ok": False, "error": self.error_text(e)}

    def call_all(self, method: str, *args, timeout: float = 60.0, **kwargs) -> list[dict]:
        """`method(*args, **kwargs)` on every rank; one outcome dict per rank, never raises."""
        return self.call_ranks(method, [args] * self.world_size, timeout, kwargs)[0]

    def rank0_call(self, method: str, *args, timeout: float | None = None):
        """Call a method on rank 0 and wait for it (its exception is raised here)."""
        return self.submit(0, method, *args).result(timeout)

    def collective_rpc(self, method: str, *args, timeout: float = 60.0, **kwargs) -> list:
        """Every rank's result, or one error naming every rank that failed."""
        outcomes = self.call_all("collective_rpc", method, *args, timeout=timeout, **kwargs)
        bad = [o for o in outcomes if not o["ok"]]
        if bad:
            raise RuntimeError("; ".join(o["error"] for o in bad))
        return [o["result"] for o in outcomes]

    def alive(self, timeout: float = 2.0) -> list[bool]:
        return [o["ok"] for o in self.call_all("collective_rpc", "ping", timeout=timeout)]

    def teardown(self, timeout: float = 5.0) -> None:
        """Stop the ranks: gracefully when all answer a ping, else kill them."""
        if all(self.alive(timeout)):
            self.shutdown()
        else:
            self.kill()

