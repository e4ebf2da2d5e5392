"""UniExecutor: TP 1 in this process, no Ray. For machines without Ray (the GPU box) and tools.

It offers the same surface as RayExecutor (rank0_call, call_all, collective_rpc, put), so the
offline LLM works unchanged on top of it.
"""

from __future__ import annotations

from .engine_config import EngineConfig
from .rank_actor import RankActor


class UniExecutor:
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

    def rank0_call(self, method: str, *args, timeout: float | None = None):
        return getattr(self.rank0, method)(*args)

    def put(self, value):
        return value

    def call_all(self, method: str, *args, timeout: float = 60.0, **kwargs) -> list[dict]:
        try:
            return [{"rank": 0, "ok": True, "result": getattr(self.rank0, method)(*args, **kwargs)}]
        except Exception as e:
            return [{"rank": 0, "ok": False, "error": f"{type(e).__name__}: {e}"}]

    def collective_rpc(self, method: str, *args, timeout: float = 60.0, **kwargs) -> list:
        return [self.rank0.collective_rpc(method, *args, **kwargs)]

    def alive(self, timeout: float = 2.0) -> list[bool]:
        return [True]

    def shutdown(self) -> None:
        self.rank0.stop()
