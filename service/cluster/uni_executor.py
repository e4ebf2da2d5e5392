"""UniExecutor: TP 1 in this process, no Ray. For machines without Ray (the GPU box) and tools.

It implements the executor interface (executor.Executor) like RayExecutor and MpExecutor:
each call runs on a thread of a small pool, as Ray's threaded actors run theirs, so a control
call (sleep, wake, diagnostics) is answered while a generate waits and a deadline can pass.
`rank0` is the RankActor itself (tools reach into its model and caches).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

from ..engine_config import EngineConfig
from .executor import Executor
from .rank_actor import RankActor


class UniExecutor(Executor):
    def __init__(self, config: EngineConfig):
        if config.tensor_parallel_size != 1:
            raise ValueError("the 'uni' executor runs TP 1 only; use 'ray' for tensor parallelism")
        self.config = config
        self.same_node = True
        self.nodes = ["local"]
        self.rank0 = RankActor(0, config)
        self.rank0.init("", True, "uni")
        self.rank0.start()
        self.actors = [self.rank0]
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="rank0", initializer=self._thread_init)

    def _thread_init(self) -> None:
        device = getattr(self.rank0, "device", None)
        if device is not None and device.type == "cuda":  # the current device is per thread
            import torch

            torch.cuda.set_device(device)

    def submit(self, rank: int, method: str, *args, **kwargs) -> Future:
        if rank != 0:
            raise IndexError(f"the 'uni' executor has rank 0 only, not {rank}")
        return self._pool.submit(getattr(self.rank0, method), *args, **kwargs)

    def alive(self, timeout: float = 2.0) -> list[bool]:
        return [True]

    def shutdown(self) -> None:
        self.rank0.stop()
        self._pool.shutdown(wait=False)

    def kill(self) -> None:
        self.shutdown()
