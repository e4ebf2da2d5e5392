"""MpExecutor: one spawned process per TP rank on this machine, no Ray
(`distributed_executor_backend="mp"`, as in vLLM).

For single-node runs where Ray is absent (the GPU box) or unwanted. Each rank process serves
its RankActor's methods over a pipe, every call on a thread of its own as Ray's threaded actors
do, so control calls (sleep, wake, diagnostics) are answered while the engine loop or the
follower loop runs. When there are fewer GPUs than ranks, ranks share them: NCCL refuses two
ranks on one device, so the group's collectives go over gloo (the fused tail still maps its
peers through cuMem FDs).
"""

from __future__ import annotations

import dataclasses
import itertools
import multiprocessing
import os
import pickle
import threading
import time
import traceback
import uuid
from concurrent.futures import Future, ThreadPoolExecutor

from ..engine_config import EngineConfig
from ..log import get_logger
from .executor import Executor, RankGone

log = get_logger("mp_executor")
_READY = -1


def _portable(e: BaseException) -> BaseException:
    """The exception itself when it survives pickling (callers catch by type), else its text."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")


def _serve(rank: int, config: EngineConfig, conn, env: dict) -> None:
    os.environ.update(env)
    from .rank_actor import RankActor

    try:
        actor = RankActor(rank, config)
    except BaseException as e:
        conn.send((_READY, False, _portable(e)))
        return
    conn.send((_READY, True, os.getpid()))
    lock = threading.Lock()

    def run(call_id: int, method: str, args: tuple, kwargs: dict) -> None:
        try:
            reply = (call_id, True, getattr(actor, method)(*args, **kwargs))
        except BaseException as e:
            log.warning("rank_call_failed", rank=rank, method=method, error=f"{type(e).__name__}: {e}",
                        traceback=traceback.format_exc(limit=-6))
            reply = (call_id, False, _portable(e))
        with lock:
            try:
                conn.send(reply)
            except (BrokenPipeError, OSError):
                pass  # the driver is gone

    with ThreadPoolExecutor(max_workers=16, thread_name_prefix=f"rank{rank}") as pool:
        while True:
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                break
            if msg is None:
                break
            pool.submit(run, *msg)
    os._exit(0)  # follower threads may sit in a collective forever: do not wait for them


class RankProcess:
    """Driver-side handle of one rank process: `call(...)` returns a Future."""

    def __init__(self, ctx, rank: int, config: EngineConfig, env: dict):
        self.rank = rank
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(rank, config, child, env), name=f"latentserve-rank{rank}",
                                daemon=True)
        self.proc.start()
        child.close()
        self._ids = itertools.count()
        self._ready: Future = Future()
        self._pending: dict[int, Future] = {_READY: self._ready}
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name=f"rank{rank}-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                call_id, ok, value = self.conn.recv()
            except (EOFError, OSError):
                break
            with self._lock:
                fut = self._pending.pop(call_id, None)
            if fut is not None:
                fut.set_result(value) if ok else fut.set_exception(value)
        with self._lock:
            pending, self._pending = self._pending, {}
        for fut in pending.values():
            fut.set_exception(RankGone(f"rank {self.rank} process exited (exit code {self.proc.exitcode})"))

    def ready(self, timeout: float):
        return self._ready.result(timeout)

    def call(self, method: str, *args, **kwargs) -> Future:
        fut: Future = Future()
        # Running from the start, so it cannot be cancelled: an asyncio caller that gives up (a
        # client's disconnect cancels its wrap_future) would otherwise cancel it, and the reply's
        # set_result raised InvalidStateError in the reader thread, which then died and left every
        # later call on this rank unanswered (seen serving on the H200, 2026-12-03).
        fut.set_running_or_notify_cancel()
        with self._lock:
            if not self._reader.is_alive():
                fut.set_exception(RankGone(f"rank {self.rank} process is not running"))
                return fut
            call_id = next(self._ids)
            self._pending[call_id] = fut
            try:
                self.conn.send((call_id, method, args, kwargs))
            except (BrokenPipeError, OSError) as e:
                self._pending.pop(call_id, None)
                fut.set_exception(RankGone(f"rank {self.rank} process is not running ({e})"))
        return fut

    def close(self, timeout: float = 10.0) -> None:
        try:
            with self._lock:
                self.conn.send(None)
        except (BrokenPipeError, OSError):
            pass
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5)


def _gpus_visible() -> int:
    import torch

    return torch.cuda.device_count()


class MpExecutor(Executor):
    """The executor interface (executor.Executor) over one spawned process per rank."""

    def __init__(self, config: EngineConfig, start_timeout: float = 600.0):
        tp = config.tensor_parallel_size
        gpus = _gpus_visible() if config.device.startswith("cuda") else 0
        if config.device.startswith("cuda") and gpus < tp and config.tp_backend == "auto":
            log.warning("ranks_share_gpus", tp=tp, gpus=gpus, backend="gloo")
            config = dataclasses.replace(config, tp_backend="gloo")
        self.config = config
        self.same_node = True
        self.nodes = ["local"] * tp
        ctx = multiprocessing.get_context("spawn")
        threads = str(max(1, (os.cpu_count() or 1) // tp))
        self.ranks: list[RankProcess] = []
        t0 = time.perf_counter()
        try:
            for rank in range(tp):
                env = {"OMP_NUM_THREADS": threads}
                if gpus:
                    env["CUDA_VISIBLE_DEVICES"] = str(rank % gpus)
                self.ranks.append(RankProcess(ctx, rank, config, env))
            for r in self.ranks:
                r.ready(start_timeout)
            addr = self.ranks[0].call("rendezvous_address", False).result(start_timeout)
            group = f"ls{uuid.uuid4().hex[:10]}"
            infos = [f.result(start_timeout) for f in [r.call("init", addr, True, group) for r in self.ranks]]
            for f in [r.call("start") for r in self.ranks]:
                f.result(start_timeout)
        except BaseException:
            self._close_all()
            raise
        self.actors = self.ranks
        self.rank0 = self.ranks[0]
        log.info("cluster_ready", tp=tp, backend="mp", seconds=round(time.perf_counter() - t0, 2),
                 fused_layers=infos[0]["tail"]["fused"])

    def submit(self, rank: int, method: str, *args, **kwargs) -> Future:
        return self.ranks[rank].call(method, *args, **kwargs)

    def shutdown(self) -> None:
        try:
            self.rank0_call("stop", timeout=20)
        except Exception:
            pass
        self._close_all()

    def kill(self) -> None:
        for r in self.ranks:
            r.close(timeout=0.0)

    def _close_all(self) -> None:
        for r in self.ranks:
            r.close()
