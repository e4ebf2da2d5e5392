"""The controller: the TP ranks of one model, its coordinator, and the routing of engine outputs.

The ranks and their lifecycle (sleep, wake, weight updates, pause/resume, restart) belong to the
`Coordinator` the offline `LLM` uses too; the controller adds what HTTP needs: one background
poller long-polls rank 0 for new outputs and routes them to per-request asyncio queues, and a
health watcher pings every rank about once a second. Blocking calls (transitions, restart) run
in worker threads so the event loop keeps streaming.
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import itertools
import os
import threading
import time

from ..cluster.backends import make_executor
from ..cluster.coordinator import Coordinator
from ..cluster.worker_rpc import DIAGNOSTICS, TEST_HOOKS, RankRPC
from ..engine_config import EngineConfig
from ..lifecycle import CoordinationError, EngineStateError
from ..log import get_logger
from ..outputs import RequestOutput
from ..sampling_params import InvalidRequest, SamplingParams
from ..weights.transports import INBOX_NAMESPACE
from .metrics import Metrics
from .protocol import APIError
from .route import Failure, Route

log = get_logger("controller")

HEALTH_INTERVAL_S = 1.0
# How long one death-watch call stays open before the controller holds the next.
PARK_S = 3600.0
# Pings that time out (a rank busy on 2 shared cores) only count after a few in a row; a dead
# actor counts at once.
MISSED_PINGS_UNHEALTHY = 3
LOOP_LAG_PERIOD_S = 0.05


class Controller:
    def __init__(self, config: EngineConfig, *, model_name: str, enable_test_hooks: bool = False,
                 deadline_s: float | None = None, request_timeout_s: float | None = None,
                 weight_snapshot: str = "off", backend: str = "ray", stream_interval: int = 1):
        self.config = config
        self.stream_interval = stream_interval  # tokens a streamed chunk (--stream-interval)
        # ray: an actor per rank (the product); mp: a process per rank, no Ray (a GPU box without
        # it): the same controller, without the Ray object-store weight transport (`refs`).
        self.backend = backend
        self.inbox, self.inbox_name = None, None
        self.model_name = model_name
        self.enable_test_hooks = enable_test_hooks
        self.deadline_s = deadline_s or float(os.environ.get("LATENTSERVE_RANK_DEADLINE_S", "120"))
        self.request_timeout_s = request_timeout_s or float(os.environ.get("LATENTSERVE_REQUEST_TIMEOUT_S", "600"))
        self.metrics = Metrics()
        # Summed over streams' first tokens: HTTP arrival (app.ArrivalStamp) to the route's start
        # (http), from there to add_request answered (admit), and arrival to the first token here.
        # With the engine's own split (its stats' first_token) they place a TTFT's time.
        self.first_token = {"requests": 0, "http_s": 0.0, "admit_s": 0.0, "ttft_s": 0.0}
        # How late the event loop runs a timer, summed: HTTP intake, every stream's chunks and the
        # poller share one loop, and a late loop delays first tokens outside the split above.
        self.loop_lag = {"samples": 0, "lag_s": 0.0}
        self.weight_snapshot = weight_snapshot  # what POST /restart keeps of tensor updates
        self.started = time.time()
        self.coordinator: Coordinator | None = None
        self.tokenizer = None
        self.health: dict = {"ok": False, "reason": "loading"}
        self.restarting = False
        self._routes: dict[str, Route] = {}
        self._ids = itertools.count()
        self._closing = threading.Event()
        self._poller: asyncio.Task | None = None
        self._lag_watch: asyncio.Task | None = None
        self._watcher: threading.Thread | None = None
        self._missed = 0

    # ---- lifecycle -----------------------------------------------------------------
    def load(self) -> None:
        """Start the ranks (blocking, minutes for big models; progress goes to the log)."""
        from ..tokenizer import get_tokenizer
        from ..weights.transports import sources, start_inbox

        t0 = time.perf_counter()
        cfg = self.config
        log.info("loading", model=cfg.model, tp=cfg.tensor_parallel_size, device=cfg.device, backend=self.backend,
                 sleep_mode=cfg.enable_sleep_mode, fused_tail=cfg.fused_tail)
        # The controller's own copy only turns token ids into strings for logprobs.
        self.tokenizer = get_tokenizer(cfg.model, cfg.model_config)
        self.coordinator = Coordinator(make_executor(cfg, self.backend), sleep_enabled=cfg.enable_sleep_mode,
                                       deadline_s=self.deadline_s, on_change=self._state_changed,
                                       weight_snapshot=self.weight_snapshot)
        if self.backend == "ray":
            self.inbox, self.inbox_name = start_inbox()
        self.coordinator.weight_sources.update(sources(cfg.model_config, self.inbox))
        self._state_changed(self.coordinator.state)
        self._watch_deaths()
        self.health = {"ok": True, "reason": None}
        log.info("ready", seconds=round(time.perf_counter() - t0, 2), nodes=len(set(self.executor.nodes)),
                 same_node=self.executor.same_node)

    @property
    def executor(self):
        """The ranks (the coordinator's; a restart replaces them)."""
        return self.coordinator.executor if self.coordinator is not None else None

    @property
    def restore(self):
        return self.coordinator.restore

    # ---- rank death, noticed when it happens ------------------------------------------
    def _watch_deaths(self) -> None:
        """Hold one `park` call open on every rank: a rank process that dies fails its call at
        once (Ray reports the actor's death), so requests get their 503 without waiting for the
        health watcher's next ping."""
        executor = self.executor
        for rank in range(executor.world_size):
            self._park(executor, rank)

    def _park(self, executor, rank: int) -> None:
        try:
            fut = executor.submit(rank, "park", PARK_S)
        except Exception:  # the rank is gone already: the health watcher reports it
            return
        fut.add_done_callback(lambda f: self._parked(executor, rank, f))

    def _parked(self, executor, rank: int, fut) -> None:
        if self._closing.is_set() or self.restarting or executor is not self.executor:
            return  # a shutdown or restart stops the ranks on purpose
        error = fut.exception()
        if error is None:
            if not fut.result():  # PARK_S passed: hold the next one
                self._park(executor, rank)
            return
        if executor.is_dead(error):
            reason = f"rank {rank} actor died: {executor.error_text(error)}; POST /restart"
            self.coordinator.mark_failed(reason)
            self.health = {"ok": False, "reason": self.coordinator.state.failed}

    async def start_background(self) -> None:
        # What startup left alive (FastAPI, pydantic, Ray's client: ~230K objects) out of the cyclic
        # GC's full collections, ~100 ms each on a 2-core CPU, which would stall every stream; the
        # rank actors do the same (RankActor._freeze_gc).
        gc.collect()
        gc.freeze()
        self._poller = asyncio.create_task(self._poll_loop(), name="rank0-poller")
        self._lag_watch = asyncio.create_task(self._watch_loop_lag(), name="loop-lag")
        self._watcher = threading.Thread(target=self._watch_health, name="health-watcher", daemon=True)
        self._watcher.start()

    async def close(self) -> None:
        gc.unfreeze()  # an in-process controller's startup objects can be collected again
        self._closing.set()
        for task in (self._poller, self._lag_watch):
            if task is not None:
                task.cancel()
        self._fail_all(503, "the server is shutting down")
        if self.executor is not None:
            await asyncio.to_thread(self.executor.shutdown)

    def _state_changed(self, state) -> None:
        self.metrics.set_state("restarting" if self.restarting else state.name)
        self.metrics.weight_version.set(state.weight_version)
        if state.failed:
            self._fail_all(503, f"the model failed: {state.failed}")

    # ---- generation -----------------------------------------------------------------
    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    async def rank0(self, method: str, *args, timeout: float | None = None):
        executor = self.executor
        fut = executor.submit(0, method, *args)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(fut), timeout or self.deadline_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            if not fut.done():  # asyncio.wait_for's TimeoutError
                raise APIError(504, f"rank 0 did not answer {method} within {timeout or self.deadline_s:g}s") from e
            if executor.is_dead(e):
                raise APIError(503, f"rank 0 is gone: {executor.error_text(e)}; POST /restart") from e
            if isinstance(e, InvalidRequest):
                raise APIError(400, str(getattr(e, "cause", None) or e), code="invalid_request") from e
            if isinstance(e, EngineStateError):  # a sleep or pause began after check_generation passed
                raise APIError(503, str(getattr(e, "cause", None) or e), code="model_state", retry=True) from e
            raise APIError(500, f"rank 0 failed {method}: {executor.error_text(e)}") from e

    def check_generation(self) -> None:
        if self.restarting:
            raise APIError(503, "the ranks are restarting; retry shortly", retry=True)
        try:
            self.coordinator.check_generation()
        except CoordinationError as e:
            raise APIError(e.status, str(e), code="model_state", retry=e.retry) from e

    async def submit(self, prompts: list[tuple[str | None, list[int] | None]], params: SamplingParams,
                     prefix: str = "cmpl") -> Route:
        """Admit and enqueue one engine request per prompt; outputs arrive on the route's queue."""
        self.check_generation()
        route = Route(asyncio.Queue(), asyncio.get_running_loop())
        base = f"{prefix}-{os.getpid()}-{next(self._ids)}"
        route.request_ids = [f"{base}-{i}" for i in range(len(prompts))]
        for rid in route.request_ids:
            self._routes[rid] = route
        try:
            for rid, (text, ids) in zip(route.request_ids, prompts):
                await self.rank0("add_request", rid, text, ids, params)
        except BaseException:
            self.release(route)
            raise
        route.admitted = True
        self.metrics.in_flight.inc()
        return route

    def release(self, route: Route) -> None:
        """Forget a route (once); abort its engine requests that may still run (client gone, error)."""
        if route.released:
            return
        route.released = True
        if route.deadline is not None:
            route.deadline.cancel()
        for rid in route.request_ids:
            self._routes.pop(rid, None)
        if route.admitted:
            self.metrics.in_flight.dec()
        unfinished = [rid for rid in route.request_ids if rid not in route.finished]
        if unfinished and self.executor is not None:
            try:
                self.executor.submit(0, "abort", unfinished)  # fire and forget
            except Exception:
                pass

    async def next_output(self, route: Route, deadline: float) -> RequestOutput:
        """The route's next output, or its failure; at `deadline` (time.monotonic) a 504 joins the
        queue behind what has arrived. One timer a route, not one an output: at 256
        streams a wait_for each output (a timer pushed and cancelled) was ~20% of this process's
        samples on an H100 (py-spy, run 80)."""
        if route.deadline is None and not route.released:
            route.deadline = asyncio.get_running_loop().call_later(
                max(0.0, deadline - time.monotonic()), route.queue.put_nowait,
                Failure(504, f"the request did not finish within {self.request_timeout_s:g}s"))
        item = await route.queue.get()
        if isinstance(item, Failure):
            raise APIError(item.status, item.message)
        return item

    @staticmethod
    def failed(out: RequestOutput) -> bool:
        """Whether `check_output` raises for `out`: plain, since a stream asks for every token
        (awaiting the coroutine each token was ~2% of the HTTP process, py-spy, run 80)."""
        return bool(out.error) or any(c.finish_reason in ("abort", "error") for c in out.outputs)

    async def check_output(self, out: RequestOutput) -> None:
        """Raise the HTTP error of a failed or aborted output. An engine error caused by a dead
        rank (a collective with a vanished peer) answers 503 like the rank death itself."""
        if not self.failed(out):
            return
        if any(c.finish_reason == "abort" for c in out.outputs):
            raise APIError(503, f"request aborted: {out.error or 'by the server'}", code="aborted")
        message = out.error or "generation failed"
        dead = await asyncio.to_thread(self._dead_ranks)
        if dead:
            self.coordinator.mark_failed("; ".join(dead) + "; POST /restart")
        if self.coordinator.state.failed:
            raise APIError(503, f"the model failed: {self.coordinator.state.failed} ({message})",
                           code="model_failed")
        raise APIError(500, message, code="engine_error")

    def _dead_ranks(self) -> list[str]:
        outcomes = self.executor.call_all("collective_rpc", "ping", timeout=2.0)
        return [o["error"] for o in outcomes if o.get("dead")]

    async def _poll_loop(self) -> None:
        while not self._closing.is_set():
            if self.restarting or self.executor is None:
                await asyncio.sleep(0.2)
                continue
            try:
                outs = await self.rank0("poll", 1.0, timeout=30.0)
            except asyncio.CancelledError:
                raise
            except APIError as e:
                if e.status == 503:
                    self._fail_all(503, e.message)
                await asyncio.sleep(0.5)
                continue
            routes = self._routes
            for rid, out, token_ids, text, logprobs, version in outs:
                route = routes.get(rid)
                if route is not None:
                    route.queue.put_nowait(route.accumulate(out) if out is not None
                                           else route.advance(rid, token_ids, text, logprobs, version))

    async def _watch_loop_lag(self) -> None:
        while True:
            t0 = time.monotonic()
            await asyncio.sleep(LOOP_LAG_PERIOD_S)
            self.loop_lag["samples"] += 1
            self.loop_lag["lag_s"] += max(0.0, time.monotonic() - t0 - LOOP_LAG_PERIOD_S)

    def _fail_all(self, status: int, message: str) -> None:
        routes = {id(r): r for r in list(self._routes.values())}
        for route in routes.values():
            route.loop.call_soon_threadsafe(route.queue.put_nowait, Failure(status, message))

    # ---- health -----------------------------------------------------------------
    def _watch_health(self) -> None:
        while not self._closing.wait(HEALTH_INTERVAL_S):
            if self.restarting or self.executor is None:
                continue
            try:
                self._check_ranks()
            except Exception as e:  # the watcher must outlive anything it observes
                log.error("health_watch_failed", error=f"{type(e).__name__}: {e}")

    def _check_ranks(self) -> None:
        outcomes = self.executor.call_all("collective_rpc", "status", timeout=2.0)
        self.metrics.ranks_alive.set(sum(o["ok"] for o in outcomes))
        dead = [o for o in outcomes if o.get("dead")]
        failed = [o["result"] for o in outcomes if o["ok"] and o["result"].get("failed")]
        slow = [o for o in outcomes if o.get("timeout")]
        self._missed = self._missed + 1 if slow else 0
        if dead:
            reason = "; ".join(o["error"] for o in dead) + "; POST /restart"
            self.coordinator.mark_failed(reason)
        elif failed:
            self.coordinator.mark_failed(f"rank {failed[0]['rank']} failed: {failed[0]['failed']}")
        if self.coordinator.state.failed:
            self.health = {"ok": False, "reason": self.coordinator.state.failed}
        elif self._missed >= MISSED_PINGS_UNHEALTHY:
            self.health = {"ok": False, "reason": "; ".join(o["error"] for o in slow)}
        else:
            self.health = {"ok": True, "reason": None}

    def health_report(self) -> tuple[bool, dict]:
        if self.restarting:
            return False, {"status": "unhealthy", "reason": "restarting the ranks"}
        ok = self.health["ok"]
        body = {"status": "ok" if ok else "unhealthy", "state": self.coordinator.state.name
                if self.coordinator else "loading"}
        if not ok:
            body["reason"] = self.health["reason"]
        return ok, body

    # ---- admin -----------------------------------------------------------------
    def collective_rpc(self, method: str, args: list, kwargs: dict, timeout: float | None,
                       ranks: list[int] | None = None) -> list[dict]:
        """Call an allowlisted diagnostic (or, with --enable-test-hooks, a test hook) on every rank,
        or on `ranks` only."""
        if method in TEST_HOOKS and not self.enable_test_hooks:
            raise APIError(403, f"{method!r} changes rank state: start the server with --enable-test-hooks")
        if method not in DIAGNOSTICS + TEST_HOOKS:
            allowed = DIAGNOSTICS + (TEST_HOOKS if self.enable_test_hooks else ())
            raise APIError(422, f"unknown collective_rpc method {method!r}; allowed: {list(allowed)}",
                           param="method")
        if kwargs:
            raise APIError(422, "collective_rpc takes positional args only", param="kwargs")
        try:  # a wrong argument count is the caller's error, not every rank's
            inspect.signature(getattr(RankRPC, "rpc_" + method)).bind(None, *args)
        except TypeError as e:
            raise APIError(422, f"collective_rpc({method}): {e}", param="args") from None
        n = self.executor.world_size
        targets = set(range(n) if ranks is None else ranks)
        if not targets <= set(range(n)):
            raise APIError(422, f"ranks must be within [0, {n})", param="ranks")
        args_per_rank = [(method, *args) if r in targets else None for r in range(n)]
        return self.executor.call_ranks("collective_rpc", args_per_rank, timeout or self.deadline_s)[0]

    def status(self) -> dict:
        executor = self.executor
        n = executor.world_size
        status = executor.call_all("collective_rpc", "status", timeout=10.0)
        memory = executor.call_all("collective_rpc", "memory_report", timeout=10.0)
        ranks = []
        for s, m in zip(status, memory):
            entry = dict(s["result"]) if s["ok"] else {"rank": s["rank"], "error": s["error"]}
            entry["alive"] = s["ok"] or not s.get("dead")
            entry["memory"] = m["result"] if m["ok"] else {"error": m["error"]}
            ranks.append(entry)
        try:
            engine = executor.rank0_call("engine_stats", timeout=10.0)
        except Exception as e:
            engine = {"error": executor.error_text(e)}
        out = {"model": self.model_name, **self.coordinator.snapshot(), "health": self.health_report()[1],
               "tp": n, "same_node": executor.same_node, "nodes": list(executor.nodes), "backend": self.backend,
               "restart_restores": self.restore.describe(), "engine": engine, "ranks": ranks,
               "first_token": {k: round(v, 6) for k, v in self.first_token.items()},
               "loop_lag": dict(self.loop_lag), "process_cpu_s": time.process_time()}
        if self.backend == "ray":
            import ray

            out["ray"] = {"address": ray.get_runtime_context().gcs_address, "namespace": INBOX_NAMESPACE,
                          "weight_inbox": self.inbox_name}
        return out

    def restart(self) -> dict:
        """Rebuild every rank through the coordinator (the served weights and their version come
        back); requests in flight fail with 503 and new ones wait for the fresh ranks."""
        self.restarting = True
        self._state_changed(self.coordinator.state)
        try:
            self._fail_all(503, "the ranks are restarting")
            report = self.coordinator.restart(lambda: make_executor(self.config, self.backend))
            self._watch_deaths()
            self._missed = 0
            self.health = {"ok": True, "reason": None}
        finally:
            self.restarting = False
            self._state_changed(self.coordinator.state)
        return report
