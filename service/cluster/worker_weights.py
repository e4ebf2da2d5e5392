"""A rank's weight updates (RankWorker's part): from a checkpoint path, tensors, Ray refs or the
trainer's sync group; the weights a level-2 sleep discarded and which are still missing; host
snapshots of what a tensor update wrote, for a restart (weights/restore.py).
"""

from __future__ import annotations

import ctypes
import time

from ..lifecycle import EngineStateError
from ..weights import checkpoint, specs


def _release_freed_heap() -> None:
    """Hand the heap that a weight load freed (checkpoint slices, received buckets) back to the
    OS: glibc keeps freed arenas, and an RLHF loop loads weights every cycle, so RSS would creep."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class RankWeights:
    """Mixed into RankWorker: needs its model, pool, tp, config, _exec_lock, _stale, weight_version."""

    def _discardable_weights(self) -> list[str]:
        import fnmatch

        globs = self.config.sleep_preserve_parameter_names
        return [s.hf_name for s in specs.weight_specs(self.config.model_config)
                if not any(fnmatch.fnmatchcase(s.param, g) for g in globs)]

    def _before_weight_update(self) -> None:
        if "weights" in self.pool.asleep_tags:
            raise EngineStateError("the weights are asleep: wake_up(tags=['weights']) before update_weights")

    def update_weights_from_path(self, path: str, version: int) -> dict:
        self._before_weight_update()
        t0 = time.perf_counter()
        with self._exec_lock:
            checkpoint.load_checkpoint(self.model, self.config.model_config, self.tp, path, progress=False)
            return self._weights_loaded(version, t0, None)

    def update_weights_from_tensors(self, named_tensors: list, version: int) -> dict:
        self._before_weight_update()
        t0 = time.perf_counter()
        named = [(n, t) for n, t in named_tensors]
        problems = specs.check_weights(self.config.model_config,
                                         {n: (tuple(t.shape), t.dtype) for n, t in named})
        if problems:
            raise ValueError("weight update rejected, nothing changed: " + "; ".join(problems))
        with self._exec_lock:
            checkpoint.load_weights(self.model, self.config.model_config, self.tp, named)
            return self._weights_loaded(version, t0, [n for n, _ in named])

    def update_weights_from_refs(self, named_refs: list, version: int) -> dict:
        """(name, ObjectRef) pairs from a trainer in the same Ray cluster (see service.weights.transports)."""
        import ray

        names = [n for n, _ in named_refs]
        tensors = ray.get([r for _, r in named_refs])
        return self.update_weights_from_tensors(list(zip(names, tensors)), version)

    def update_weights_from_group(self, host: str, port: int, metas: list[dict], version: int,
                                  bucket_bytes: int, backend: str = "gloo", timeout_s: float = 120.0) -> dict:
        """Join the trainer's sync group as rank (tp_rank + 1) and load what it broadcasts."""
        from ..weights.sync import SyncGroup, TensorMeta

        self._before_weight_update()
        t0 = time.perf_counter()
        tmetas = [TensorMeta.from_json(m) for m in metas]
        group = SyncGroup(host, port, self.rank + 1, self.world_size + 1, backend=backend,
                          timeout_s=timeout_s, device=str(self.device))
        received = 0
        try:
            with self._exec_lock:
                for name, tensor in group.receive(tmetas, bucket_bytes):
                    checkpoint.load_weights(self.model, self.config.model_config, self.tp, [(name, tensor)])
                    received += tensor.numel() * tensor.element_size()
                report = self._weights_loaded(version, t0, [m.name for m in tmetas])
        except BaseException as e:
            group.abandon(f"rank {self.rank} gave up: {type(e).__name__}: {e}")
            raise
        finally:
            group.close()
        report["bytes"] = received
        report["gbps"] = round(received / max(report["seconds"], 1e-9) / 1e9, 3)
        return report

    def _weights_loaded(self, version: int, t0: float, names: list[str] | None) -> dict:
        """names: the weights written (None: a whole checkpoint)."""
        self._stale = set() if names is None else self._stale - set(names)
        self.last_written = names
        if not self._stale:
            self.pool.mark_weights_loaded()
        self.weight_version = version
        _release_freed_heap()
        return {"rank": self.rank, "weight_version": version, "weights_valid": self.pool.weights_valid,
                "missing_weights": len(self._stale), "seconds": round(time.perf_counter() - t0, 4)}

    def snapshot_params(self) -> dict:
        """Host copies of the parameters the last tensor update wrote (what /restart restores)."""
        from ..weights.restore import snapshot_params

        return snapshot_params(self)

    def restore_params(self, snapshot: dict, version: int) -> dict:
        from ..weights.restore import restore_params

        return restore_params(self, snapshot, version)
