"""The executor backends by name: `ray` (the product: an actor per rank), `mp` (a process per rank
on this machine, no Ray) and `uni` (TP 1 in this process). Each is imported only when chosen, so
a machine without Ray runs `mp` and `uni`."""

from __future__ import annotations

from ..engine_config import EngineConfig
from .executor import Executor


def make_executor(config: EngineConfig, backend: str) -> Executor:
    """'ray' (the product: one actor per rank), 'mp' (one process per rank on this machine, no
    Ray) or 'uni' (TP 1 in this process: tools, the GPU box)."""
    if backend == "ray":
        from .ray_executor import RayExecutor

        return RayExecutor(config)
    if backend == "mp":
        from .mp_executor import MpExecutor

        return MpExecutor(config)
    if backend == "uni":
        from .uni_executor import UniExecutor

        return UniExecutor(config)
    raise ValueError(f"distributed_executor_backend must be 'ray', 'mp' or 'uni', got {backend!r}")
