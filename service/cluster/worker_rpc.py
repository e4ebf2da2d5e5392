"""What collective_rpc may call on a rank (RankWorker's part): read-only diagnostics, and the
state-changing test hooks the fault tests and verify-sleep's negative control use (allowed over
HTTP only with `serve --enable-test-hooks`).
"""

from __future__ import annotations

import os
import threading

import torch

from ..engine.plan import encode_message
from ..lifecycle import EngineStateError

# Read-only diagnostics that collective_rpc may call (plus test hooks, see below).
DIAGNOSTICS = ("tail_state", "weight_checksums", "memory_report", "data_ptrs", "ping", "status", "graph_stats")
# Hooks that change state; only for tests and verify-sleep's negative control.
TEST_HOOKS = ("zero_tail_flags", "probe_forward", "fail_next_sleep")


class RankRPC:
    """Mixed into RankWorker: needs its model, pool, collective, rank, _exec_lock, _lead."""

    _probe_cv: threading.Condition
    _probe_results: list[dict]

    def collective_rpc(self, method: str, *args, **kwargs):
        if method not in DIAGNOSTICS + TEST_HOOKS:
            raise ValueError(f"unknown collective_rpc method {method!r}; allowed: {DIAGNOSTICS + TEST_HOOKS}")
        return getattr(self, "rpc_" + method)(*args, **kwargs)

    def rpc_ping(self) -> dict:
        return {"rank": self.rank, "pid": os.getpid()}

    def _flags_readable(self) -> bool:
        return "weights" not in self.pool.asleep_tags

    def rpc_tail_state(self) -> list[dict]:
        return [r.state(live=self._flags_readable()) for r in self.model.tail_runners()]

    def tail_epochs(self) -> dict | None:
        """Flag state of the fused tail; while the weights sleep, as it was when they went to sleep."""
        if self.collective is None:
            return None
        if not self._flags_readable():
            return {**(self._epochs_at_sleep or {}), "as_of": "sleep"}
        return self.collective.state()

    def tail_summary(self) -> dict:
        runners = self.model.tail_runners() if self.model is not None else []
        return {"layers": len(runners), "fused": sum(r.fused for r in runners),
                "reason": next((r.disabled_reason for r in runners if not r.fused), None)}

    def rpc_weight_checksums(self) -> dict:
        with torch.inference_mode():
            total = sum(float(p.double().abs().sum()) for p in self.model.parameters())
        return {"rank": self.rank, "weight_version": self.weight_version, "abs_sum": total}

    def rpc_memory_report(self) -> dict:
        d = self.pool.describe()
        d["rank"] = self.rank
        return d

    def rpc_data_ptrs(self) -> dict:
        return self.pool.data_ptrs()

    def rpc_status(self) -> dict:
        return {"rank": self.rank, "node": self.node_id(), "asleep": sorted(self.pool.asleep_tags),
                "weights_valid": self.pool.weights_valid, "weight_version": self.weight_version,
                "failed": self.failed, "recoveries": self.recoveries, "last_failure": self.last_failure,
                "tail": self.tail_summary(), "tail_epochs": self.tail_epochs()}

    def rpc_graph_stats(self) -> dict:
        """Decode CUDA graphs and prefill graphs (None: eager), the device collectives' calls and epochs."""
        comm = self.tp.device_comm
        prefill = self.prefill_graphs
        return {"rank": self.rank, "graphs": self.decode_graphs.stats() if self.decode_graphs is not None else None,
                "prefill_graphs": prefill.stats() if prefill is not None else None,
                "device_comm": None if comm is None else {"calls": comm.calls, "epochs": comm.epochs()
                                                          if self._flags_readable() else None}}

    def rpc_zero_tail_flags(self) -> dict:
        """Negative control: lose the Lamport flags as the old level 2 did."""
        if self.collective is None:
            raise EngineStateError("no fused tail on this rank")
        self.collective.zero_flags()
        return {"rank": self.rank, "tail_epochs": self.tail_epochs()}

    def rpc_probe_forward(self, token_ids: list[int], timeout: float = 60.0) -> dict:
        """One cache-less forward regardless of sleep state, on all ranks: NaN shows stale reads.

        It needs the TP group, so rank 0 sends it down the plan channel like a step; the other
        ranks answer with the result their follower loop got.
        """
        if self.rank == 0:
            if self.world_size == 1:
                return self._probe(token_ids)
            return self._lead(encode_message("probe", list(token_ids)), lambda: self._probe(token_ids))
        with self._probe_cv:
            if not self._probe_cv.wait_for(lambda: self._probe_results, timeout):
                raise TimeoutError(f"rank {self.rank}: no probe arrived from rank 0 within {timeout}s")
            return self._probe_results.pop(0)

    def _probe(self, token_ids: list[int]) -> dict:
        from ..engine.plan import SeqChunk

        with self._exec_lock, torch.inference_mode():
            chunks = [SeqChunk(seq_id=0, token_ids=list(token_ids), start_pos=0, block_table=[])]
            logits = self._eager_forward(chunks, None)
        return {"rank": self.rank, "nan": bool(torch.isnan(logits).any()),
                "argmax": int(logits[-1].nan_to_num(-1e30).argmax())}

    def rpc_fail_next_sleep(self, rank: int | None = None) -> dict:
        """Test hook: this rank's next sleep raises before it releases anything (one shot).
        With `rank` only that rank arms it (`collective_rpc("fail_next_sleep", 1)`)."""
        armed = rank is None or rank == self.rank
        if armed:
            self._fail_next_sleep = True
        return {"rank": self.rank, "armed": armed}
