"""What `POST /restart` brings back: the weights being served and their `weight_version`.

Fresh ranks start with the startup weights. On top of that a restart replays, in order:

- the base: the last `{"path": DIR}` update, reloaded from its checkpoint (no memory cost);
- the overlay, with `--weight-snapshot host`: host copies of every parameter a later tensor
  update (`group`, `refs`) wrote, taken right after each update (while the engine is still
  paused) and merged, newest first. Its cost is those parameters' bytes in the controller's
  memory, reported in `/v1/status` under `restart_restores`.

With snapshots off a `group` or `refs` update cannot be replayed: a restart brings back the base
and its version, and `/v1/status` says which update would be lost. A path update resets the
overlay: the checkpoint holds everything.

The rank side (`snapshot_params`, `restore_params`) works on model parameters by name, so the
restore is bit-exact and needs the same TP size and model config, which a restart keeps.
"""

from __future__ import annotations

import time

import torch

from ..lifecycle import CoordinationError
from ..log import get_logger

log = get_logger("weight_restore")

MODES = ("off", "host")


class RestorePlan:
    """Controller side: the base checkpoint and the per-rank parameter overlay, with versions."""

    def __init__(self, mode: str = "off"):
        if mode not in MODES:
            raise ValueError(f"weight snapshot mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.base_path: str | None = None
        self.base_version = 0
        self.overlay: list[dict[str, torch.Tensor]] | None = None  # per rank: parameter -> host copy
        self.overlay_version: int | None = None
        self.overlay_sources: list[str] = []
        self.lost: str | None = None  # an update a restart cannot bring back
        self.last_snapshot_seconds: float | None = None

    # ---- after each successful update (inside the update's transition) -------------------
    def updated(self, kind: str, source, version: int, executor, timeout: float) -> dict:
        """Record what a restart needs to bring this update back; returns a short report."""
        if kind == "path":
            self.base_path, self.base_version = source, version
            self.overlay, self.overlay_version, self.overlay_sources, self.lost = None, None, [], None
            return {"restart_restores": "path", "path": source}
        if self.mode == "off":
            self.lost = (f"the {kind} update to version {version} (a host weight snapshot, serve --weight-snapshot "
                         f"host or LLM(weight_snapshot='host'), keeps tensor updates across restarts)")
            return {"restart_restores": "base", "lost": self.lost}
        t0 = time.perf_counter()
        outcomes, _ = executor.call_ranks("snapshot_params", [()] * executor.world_size, timeout)
        bad = [o["error"] for o in outcomes if not o["ok"]]
        if bad:
            self.lost = f"the {kind} update to version {version}: its snapshot failed ({'; '.join(bad)})"
            log.error("snapshot_failed", version=version, error=self.lost)
            return {"restart_restores": "base", "lost": self.lost}
        overlay = self.overlay or [{} for _ in outcomes]
        for per_rank, o in zip(overlay, outcomes):
            per_rank.update(o["result"])
        self.overlay, self.overlay_version, self.lost = overlay, version, None
        self.overlay_sources = (self.overlay_sources + [kind])[-8:]
        self.last_snapshot_seconds = round(time.perf_counter() - t0, 4)
        snap = self.describe()["snapshot"]
        log.info("snapshot", version=version, params=snap["params"], bytes=snap["bytes"],
                 seconds=self.last_snapshot_seconds)
        return {"restart_restores": "snapshot", **snap}

    # ---- at restart ---------------------------------------------------------------------
    def restore(self, executor, timeout: float) -> tuple[int, dict]:
        """Bring fresh ranks to the served weights; returns (weight_version, report)."""
        n = executor.world_size
        version, report = 0, {"from": "startup weights", "path": None, "snapshot": None}
        if self.base_path is not None:
            outcomes, _ = executor.call_ranks("update_weights_from_path", [(self.base_path, self.base_version)] * n,
                                              timeout)
            bad = [o["error"] for o in outcomes if not o["ok"]]
            if bad:
                raise CoordinationError(500, f"restart could not reload {self.base_path}: {bad}", outcomes)
            version, report["path"], report["from"] = self.base_version, self.base_path, "path"
        if self.overlay is not None:
            outcomes, _ = executor.call_ranks("restore_params", [(p, self.overlay_version) for p in self.overlay],
                                              timeout)
            bad = [o["error"] for o in outcomes if not o["ok"]]
            if bad:
                raise CoordinationError(500, f"restart could not restore the weight snapshot: {bad}", outcomes)
            version = self.overlay_version
            report["snapshot"] = self.describe()["snapshot"]
            report["from"] = "path + snapshot" if self.base_path else "startup weights + snapshot"
        report["lost"] = self.lost
        self.lost = None  # what is served from now on is what was restored
        return version, report

    def describe(self) -> dict:
        """For /v1/status: what a restart would bring back, and what the snapshot costs."""
        snap = None
        if self.overlay is not None:
            tensors = [t for per_rank in self.overlay for t in per_rank.values()]
            snap = {"version": self.overlay_version, "params": len(self.overlay[0]) if self.overlay else 0,
                    "bytes": sum(t.numel() * t.element_size() for t in tensors), "sources": self.overlay_sources,
                    "seconds": self.last_snapshot_seconds}
        version = self.overlay_version if self.overlay is not None else self.base_version
        source = "snapshot" if self.overlay is not None else ("path" if self.base_path else "startup weights")
        return {"mode": self.mode, "source": source, "weight_version": version, "path": self.base_path,
                "path_version": self.base_version if self.base_path else None, "snapshot": snap,
                "lost": self.lost}


# ---- rank side ---------------------------------------------------------------------------------

def written_params(worker, hf_names: list[str]) -> list[str]:
    """The model parameters that hold these checkpoint tensors on this rank."""
    from .fp8 import SCALE_SUFFIX
    from .specs import canonical_name, weight_specs

    cfg = worker.config.model_config
    by_name = {s.hf_name: s.param for s in weight_specs(cfg)}
    written = {by_name[c] for c in (canonical_name(cfg, n) for n in hf_names) if c in by_name}
    # An FP8 weight's update (bf16 quantized on the rank, or fp8 + scale) writes its scales too.
    held = dict(worker.model.named_parameters())
    return sorted(written | {p + SCALE_SUFFIX for p in written if p + SCALE_SUFFIX in held})


@torch.no_grad()
def snapshot_params(worker) -> dict[str, torch.Tensor]:
    """Host copies of the parameters the last tensor update wrote."""
    names = worker.last_written
    if names is None:
        raise RuntimeError("the last weight update was a whole checkpoint: nothing to snapshot")
    params = dict(worker.model.named_parameters())
    with worker._exec_lock:
        return {p: params[p].detach().to("cpu", copy=True) for p in written_params(worker, names)}


@torch.no_grad()
def restore_params(worker, snapshot: dict[str, torch.Tensor], version: int) -> dict:
    """Copy snapshot parameters into this rank's model (in place: addresses and graphs stay valid)."""
    params = dict(worker.model.named_parameters())
    problems = [f"{n}: unknown" for n in snapshot if n not in params]
    problems += [f"{n}: snapshot {list(t.shape)} vs parameter {list(params[n].shape)}"
                 for n, t in snapshot.items() if n in params and tuple(t.shape) != tuple(params[n].shape)]
    if problems:
        raise ValueError("weight snapshot does not fit this model, nothing restored: " + "; ".join(problems[:10]))
    with worker._exec_lock:
        for n, t in snapshot.items():
            params[n].data.copy_(t)
    worker.weight_version = version
    return {"rank": worker.rank, "weight_version": version, "params": len(snapshot),
            "bytes": sum(t.numel() * t.element_size() for t in snapshot.values())}
