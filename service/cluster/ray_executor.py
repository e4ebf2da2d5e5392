"""Ray executor: one placement group, one actor per TP rank, ranks ordered by node.

Rank 0 hosts the engine loop; the driver talks to it per request (not per step), and to all
ranks in parallel, with a deadline, for sleep/wake/weight updates and diagnostics.
"""

from __future__ import annotations

import os
import time
import uuid
from concurrent.futures import Future

import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..engine_config import EngineConfig
from ..log import get_logger
from .executor import Executor, first_line
from .rank_actor import RankActor

log = get_logger("executor")


def ensure_ray(address: str | None) -> None:
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=True)
    else:
        # The embedded default: a local cluster on this machine's cores.
        ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=True)


class RayExecutor(Executor):
    def __init__(self, config: EngineConfig):
        self.config = config
        tp = config.tensor_parallel_size
        gpu = config.device.startswith("cuda")
        ensure_ray(config.ray_address)
        # Ranks share the cores when there are fewer than TP (each rank also gets cores/TP threads).
        per_rank = config.num_cpus_per_rank or min(1.0, ray.cluster_resources().get("CPU", 1.0) / tp)
        bundle = {"CPU": per_rank, **({"GPU": 1} if gpu else {})}
        self.pg = placement_group([dict(bundle) for _ in range(tp)], strategy="PACK")
        ray.get(self.pg.ready(), timeout=120)
        order, nodes = self._bundles_by_node(tp)
        self.nodes = nodes
        self.same_node = len(set(nodes)) == 1
        actor_cls = ray.remote(max_concurrency=16)(RankActor)
        env = {"env_vars": {"OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // tp))}}
        self.actors = []
        for rank, bundle_index in enumerate(order):
            opts = dict(
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.pg, placement_group_bundle_index=bundle_index),
                num_cpus=per_rank, runtime_env=env,
            )
            if gpu:
                opts["num_gpus"] = 1
            self.actors.append(actor_cls.options(**opts).remote(rank, config))
        t0 = time.perf_counter()
        addr = ray.get(self.actors[0].rendezvous_address.remote(not self.same_node))
        group = f"ls{uuid.uuid4().hex[:10]}"
        infos = ray.get([a.init.remote(addr, self.same_node, group) for a in self.actors])
        ray.get([a.start.remote() for a in self.actors])
        self.rank0 = self.actors[0]
        log.info("cluster_ready", tp=tp, nodes=len(set(nodes)), seconds=round(time.perf_counter() - t0, 2),
                 fused_layers=infos[0]["tail"]["fused"])

    def _bundles_by_node(self, tp: int) -> tuple[list[int], list[str]]:
        table = placement_group_table(self.pg)
        b2n = table.get("bundles_to_node_id", {})
        here = ray.get_runtime_context().get_node_id()
        # Rank 0's node first (the driver's node when it has a bundle), then by node, then bundle index.
        key = {n: (0 if n == here else 1, n) for n in set(b2n.values())}
        order = sorted(range(tp), key=lambda i: (key.get(b2n.get(i), (2, "")), i))
        return order, [b2n.get(i, "?") for i in order]

    # ---- the executor interface ------------------------------------------------------
    def submit(self, rank: int, method: str, *args, **kwargs) -> Future:
        return getattr(self.actors[rank], method).remote(*args, **kwargs).future()

    def is_dead(self, e: BaseException) -> bool:
        return isinstance(e, ray.exceptions.RayActorError)

    def error_text(self, e: BaseException) -> str:
        return error_text(e)

    def put(self, value):
        return ray.put(value)

    def shutdown(self) -> None:
        try:
            ray.get(self.rank0.stop.remote(), timeout=20)
        except Exception:
            pass
        self.kill()

    def kill(self) -> None:
        for a in self.actors:
            try:
                ray.kill(a)
            except Exception:
                pass
        try:
            remove_placement_group(self.pg)
        except Exception:
            pass


def error_text(e: BaseException) -> str:
    """The innermost message of a Ray task failure, without Ray's traceback framing."""
    cause = getattr(e, "cause", None)
    if cause is not None and not isinstance(cause, ray.exceptions.RayError):
        return f"{type(cause).__name__}: {cause}"
    return f"{type(e).__name__}: {first_line(e)}"
