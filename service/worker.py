"""RankWorker: one TP rank's model shard, memory pool, KV cache and fused-tail state.

Rank 0 also hosts the engine (see `engine_loop.py`): it broadcasts each step plan to the other
ranks over the CPU process group, so there is no per-step Ray call. The other ranks run
`follow()`, which executes whatever plan arrives until told to stop.

This class knows nothing about Ray: `executor.py` wraps it in an actor.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
import time

import torch

from .engine.plan import StepPlan, decode_message, encode_message
from .engine_config import EngineConfig
from .log import get_logger
from .net import free_port
from .parallel import TPGroup, set_cpu_threads

log = get_logger("worker")


def _release_freed_heap() -> None:
    """Hand the heap that a weight load freed (checkpoint slices, received buckets) back to the
    OS: glibc keeps freed arenas, and an RLHF loop loads weights every cycle, so RSS would creep."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class EngineStateError(RuntimeError):
    """The rank cannot run a forward in its current state (asleep, weights discarded, failed)."""


# Read-only diagnostics that collective_rpc may call (plus test hooks, see below).
DIAGNOSTICS = ("tail_state", "weight_checksums", "memory_report", "data_ptrs", "ping", "status")
# Hooks that change state; only for tests and verify-sleep's negative control.
TEST_HOOKS = ("zero_tail_flags", "probe_forward", "fail_next_sleep")


class RankWorker:
    def __init__(self, rank: int, config: EngineConfig):
        self.rank = rank
        self.config = config
        self.world_size = config.tensor_parallel_size
        self.tp = TPGroup.single()
        self.model = None
        self.pool = None
        self.collective = None
        self.kv_caches: list = []  # per layer: MLA KV blocks or a KDAState
        self.weight_version = 0
        self.failed: str | None = None
        self.recoveries = 0  # failed steps after which every rank re-armed and served on
        self.last_failure: str | None = None
        self.last_written: list[str] | None = None  # checkpoint names the last tensor update wrote
        self.same_node = True
        self._exec_lock = threading.Lock()
        self._plan_lock = threading.Lock()
        self._fail_next_sleep = False
        self._follower_thread: threading.Thread | None = None
        self._probe_cv = threading.Condition()
        self._probe_results: list[dict] = []
        self._stale: set[str] = set()  # weights discarded by level 2 and not yet reloaded
        self.decode_graphs = None  # CUDA graphs of the decode step (model/cuda_graph.py)
        self._epochs_at_sleep: dict | None = None

    # ---- setup -----------------------------------------------------------------
    def rendezvous_address(self, multi_node: bool = False) -> str:
        """Called on rank 0: a TCP address for torch.distributed, reachable from every rank's node."""
        host = "127.0.0.1"
        if multi_node:
            import ray

            host = ray.util.get_node_ip_address()
        return f"tcp://{host}:{free_port(host)}"

    def node_id(self) -> str:
        try:
            import ray

            if ray.is_initialized():  # asking otherwise would start a local Ray instance
                return ray.get_runtime_context().get_node_id()
        except ImportError:  # no Ray on this machine (the GPU box)
            pass
        return socket.gethostname()

    def init(self, init_method: str, same_node: bool = True, group_name: str = "ls") -> dict:
        t0 = time.perf_counter()
        cfg = self.config
        self.same_node = same_node
        threads = set_cpu_threads(self.world_size, self.rank) if cfg.device == "cpu" else None
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda":
            # Ray gives each rank actor its own visible GPU, so a bare "cuda" means index 0;
            # newer torch refuses set_device without an index, and NCCL wants it set first.
            if self.device.index is None:
                self.device = torch.device("cuda", 0)
            torch.cuda.set_device(self.device)
        self.tp = TPGroup.init(self.rank, self.world_size, init_method, backend=cfg.process_group_backend)
        if same_node:
            self.tp.use_shared_memory(group_name)
        self._build_model(group_name)
        self._load_initial_weights()
        self._allocate_kv_cache()
        if self.device.type == "cuda":
            from .model.cuda_graph import for_worker

            self.decode_graphs = for_worker(self.model, self.kv_caches, cfg)
        self.tp.barrier()
        info = {"rank": self.rank, "threads": threads, "seconds": round(time.perf_counter() - t0, 3),
                "tail": self.tail_summary()}
        log.info("rank_ready", **info)
        return info

    def _build_model(self, group_name: str) -> None:
        from .memory.pool import MemoryPool
        from .model.model import CausalLM
        from .tail.base import TailRunner

        cfg = self.config
        mcfg = cfg.model_config
        # The pool exists before the model so the tail's flags and peer table are named state in it.
        self.pool = MemoryPool(self.device, layout=cfg.pool_layout, poison=cfg.poison_discarded)
        if self.tp.shm is not None:  # exchange memory outside the pool: kept by every sleep level
            self.pool.register_comm("tp_collectives", self.tp.shm.nbytes)
        self.collective = self._make_collective(group_name)
        mode = cfg.fused_tail

        def tail_factory(layer_idx: int) -> TailRunner:
            runner = TailRunner(layer_idx, self.tp, mode, self.collective)
            if self.collective is None and mode != "off":
                runner.disabled_reason = self._no_fusion_reason()
            return runner

        with torch.device("meta"):
            model = CausalLM(mcfg, self.tp, tail_factory=tail_factory, dtype=cfg.torch_dtype)
        self.pool.materialize(model, list(cfg.sleep_preserve_parameter_names))
        model.reset_buffers()
        model.eval()
        self.model = model

    def _no_fusion_reason(self) -> str:
        if self.world_size == 1:
            return "TP 1: nothing to reduce"
        if not self.same_node:
            return "ranks span several nodes: the CPU fused tail needs one node's shared memory"
        if not self.config.model_config.is_latent:
            return "not a latent-MoE model"
        return "fused tail unavailable"

    def _make_collective(self, group_name: str):
        cfg = self.config
        mcfg = cfg.model_config
        if cfg.fused_tail == "off" or self.world_size == 1 or not self.same_node or not mcfg.is_latent:
            return None
        if self.device.type == "cuda":
            from .tail.triton_tail import TritonTailCollective as Collective
        else:
            from .tail.shm import ShmTailCollective as Collective
        return Collective(
            self.rank, self.world_size, max_tokens=cfg.fused_tail_max_tokens,
            latent_dim=mcfg.moe_latent_size, hidden_dim=mcfg.hidden_size, dtype=cfg.torch_dtype,
            state_alloc=self.pool.state, group_name=group_name, deadline_s=cfg.tail_deadline_s,
            barrier=self.tp.barrier,
        )

    def _load_initial_weights(self) -> None:
        from . import weights

        cfg = self.config
        if cfg.checkpoint_dir:
            weights.load_checkpoint(self.model, cfg.model_config, self.tp, cfg.checkpoint_dir,
                                    progress=self.rank == 0)
        else:
            weights.init_dummy_weights(self.model, cfg.model_config, self.tp, seed=cfg.seed)
        self.pool.mark_weights_loaded()

    def _allocate_kv_cache(self) -> None:
        """One cache per layer, all under the kv_cache tag (level 1 and 2 release them alike): the
        paged compressed KV of an MLA layer, or a KDA layer's per-sequence state rows (one row per
        scheduler state slot: conv history and recurrent state)."""
        cfg = self.config
        mcfg = cfg.model_config
        shape = (cfg.kv_blocks(), cfg.block_size, mcfg.kv_cache_dim)
        self.kv_caches = []
        for i in range(mcfg.num_hidden_layers):
            if not mcfg.is_kda_layer(i):
                self.kv_caches.append(self.pool.allocate("kv_cache", f"kv_cache.{i}", shape, cfg.torch_dtype))
                continue
            from .model.kda import KDAState, kda_state_shapes

            rows = {name: self.pool.allocate("kv_cache", f"kda_state.{i}.{name}", (cfg.max_num_seqs, *row),
                                             dtype or cfg.torch_dtype)
                    for name, (row, dtype) in kda_state_shapes(mcfg, self.world_size).items()}
            self.kv_caches.append(KDAState(**rows))

    # ---- execution -----------------------------------------------------------------
    def refusal(self) -> str | None:
        """Why this rank cannot run a forward now, or None."""
        if self.failed:
            return f"rank {self.rank} failed earlier and needs a restart: {self.failed}"
        asleep = self.pool.asleep_tags
        if "weights" in asleep:
            return "the weights are asleep: call wake_up(tags=['weights']) first"
        if "kv_cache" in asleep:
            return "the KV cache is asleep: call wake_up(tags=['kv_cache']) first"
        if not self.pool.weights_valid:
            missing = sorted(self._stale)
            detail = f" ({len(missing)} still missing, e.g. {missing[0]})" if missing else ""
            return ("level-2 sleep discarded the weights: load new weights (update_weights) before "
                    f"generating{detail}")
        return None

    def check_runnable(self) -> None:
        reason = self.refusal()
        if reason:
            raise EngineStateError(reason)

    def execute(self, plan: StepPlan) -> torch.Tensor | None:
        with self._exec_lock, torch.inference_mode():
            if self.decode_graphs is not None:
                logits = self.decode_graphs.run(plan.chunks)
                if logits is not None:
                    return logits
            return self._eager_forward(plan.chunks, self.kv_caches)

    def _eager_forward(self, chunks: list, kv_caches: list | None) -> torch.Tensor | None:
        """Logits of the chunks that need them (None if none do); kv_caches=None: cache-less."""
        from .model.attention import AttnMetadata

        meta = AttnMetadata.build(chunks, self.config.block_size, self.device)
        ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long, device=self.device)
        hidden = self.model(ids, meta, kv_caches)
        if meta.logits_indices.numel() == 0:
            return None
        return self.model.compute_logits(hidden[meta.logits_indices])

    def execute_step(self, plan: StepPlan) -> torch.Tensor | None:
        """Rank 0: send the plan to every rank, then run it here too."""
        self.check_runnable()
        return self._lead(encode_message("step", plan), lambda: self.execute(plan))

    def _lead(self, message, run):
        """Rank 0: broadcast a plan or probe, then run it. A failure on any rank re-arms every
        rank (recovery.py) before this raises, so the next plan runs on a clean TP group and tail."""
        with self._plan_lock:  # plans and probes reach the followers in one order
            shm = self.tp.shm
            if shm is not None and shm.resync_requested():  # a follower failed after the last plan
                self._recover(None)
                self.check_runnable()
            try:
                self.tp.broadcast_ints(message)
                return run()
            except Exception as e:
                err = self._recover(e)
                if err is e:
                    raise
                raise err from e

    def _recover(self, error: Exception | None):
        from .recovery import recover

        return recover(self, error)

    def follow(self) -> None:
        """Ranks > 0: execute broadcast plans until a stop message. A failed step (here or on a
        peer) is recovered from in place (recovery.py); rank 0 reports the error to clients."""
        while True:
            try:
                kind, payload = decode_message(self.tp.broadcast_ints(None, wait_forever=True))
            except Exception as e:  # a peer asked for a resync, or the channel broke
                self._recover(e)
                continue
            if kind == "stop":
                return
            try:
                if kind == "probe":
                    result = self._probe(payload)
                    with self._probe_cv:
                        self._probe_results.append(result)
                        self._probe_cv.notify_all()
                else:
                    self.execute(payload)
            except Exception as e:  # keep following once every rank is re-armed
                self._recover(e)

    def start_following(self) -> None:
        if self.rank == 0 or self.world_size == 1:
            return
        self._follower_thread = threading.Thread(target=self.follow, name=f"follow-{self.rank}", daemon=True)
        self._follower_thread.start()

    def stop_followers(self) -> None:
        if self.rank == 0 and self.world_size > 1:
            self.tp.broadcast_ints(encode_message("stop"))

    # ---- sleep -----------------------------------------------------------------
    def sleep(self, level: int) -> dict:
        if self._fail_next_sleep:
            self._fail_next_sleep = False
            raise RuntimeError(f"rank {self.rank}: injected sleep failure (test hook)")
        with self._exec_lock:
            if level > 0 and self._flags_readable():
                # The flags live in weights memory, unmapped (GPU) or zeroed (CPU) while it sleeps.
                self._epochs_at_sleep = self.tail_epochs()
            report = self.pool.sleep(level) if level > 0 else {"level": 0, "noop": "level 0 only pauses"}
            if not self.pool.weights_valid and not self._stale:
                # Level 2 discarded parameter memory: every non-preserved weight must be sent again.
                self._stale = set(self._discardable_weights())
        return self._report(report)

    def _discardable_weights(self) -> list[str]:
        import fnmatch

        from .weights import weight_specs

        globs = self.config.sleep_preserve_parameter_names
        return [s.hf_name for s in weight_specs(self.config.model_config)
                if not any(fnmatch.fnmatchcase(s.param, g) for g in globs)]

    def wake_up(self, tags: list[str] | None = None) -> dict:
        with self._exec_lock:
            report = self.pool.wake_up(tags)
        return self._report(report)

    def _report(self, report: dict) -> dict:
        report = dict(report)
        report["rank"] = self.rank
        report["asleep"] = sorted(self.pool.asleep_tags)
        report["weights_valid"] = self.pool.weights_valid
        report["tail_epochs"] = self.tail_epochs()
        return report

    # ---- weights -----------------------------------------------------------------
    def _before_weight_update(self) -> None:
        if "weights" in self.pool.asleep_tags:
            raise EngineStateError("the weights are asleep: wake_up(tags=['weights']) before update_weights")

    def update_weights_from_path(self, path: str, version: int) -> dict:
        from . import weights

        self._before_weight_update()
        t0 = time.perf_counter()
        with self._exec_lock:
            weights.load_checkpoint(self.model, self.config.model_config, self.tp, path, progress=False)
            return self._weights_loaded(version, t0, None)

    def update_weights_from_tensors(self, named_tensors: list, version: int) -> dict:
        from . import weights

        self._before_weight_update()
        t0 = time.perf_counter()
        named = [(n, t) for n, t in named_tensors]
        problems = weights.check_weights(self.config.model_config,
                                         {n: (tuple(t.shape), t.dtype) for n, t in named})
        if problems:
            raise ValueError("weight update rejected, nothing changed: " + "; ".join(problems))
        with self._exec_lock:
            weights.load_weights(self.model, self.config.model_config, self.tp, named)
            return self._weights_loaded(version, t0, [n for n, _ in named])

    def update_weights_from_refs(self, named_refs: list, version: int) -> dict:
        """(name, ObjectRef) pairs from a trainer in the same Ray cluster (see weight_transports)."""
        import ray

        names = [n for n, _ in named_refs]
        tensors = ray.get([r for _, r in named_refs])
        return self.update_weights_from_tensors(list(zip(names, tensors)), version)

    def update_weights_from_group(self, host: str, port: int, metas: list[dict], version: int,
                                  bucket_bytes: int, backend: str = "gloo", timeout_s: float = 120.0) -> dict:
        """Join the trainer's sync group as rank (tp_rank + 1) and load what it broadcasts."""
        from . import weights
        from .weight_sync import SyncGroup, TensorMeta

        self._before_weight_update()
        t0 = time.perf_counter()
        tmetas = [TensorMeta.from_json(m) for m in metas]
        group = SyncGroup(host, port, self.rank + 1, self.world_size + 1, backend=backend,
                          timeout_s=timeout_s, device=str(self.device))
        received = 0
        try:
            with self._exec_lock:
                for name, tensor in group.receive(tmetas, bucket_bytes):
                    weights.load_weights(self.model, self.config.model_config, self.tp, [(name, tensor)])
                    received += tensor.numel() * tensor.element_size()
                report = self._weights_loaded(version, t0, [m.name for m in tmetas])
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
        from .weight_restore import snapshot_params

        return snapshot_params(self)

    def restore_params(self, snapshot: dict, version: int) -> dict:
        from .weight_restore import restore_params

        return restore_params(self, snapshot, version)

    # ---- diagnostics -----------------------------------------------------------------
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
        from .engine.plan import SeqChunk

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

    def shutdown(self) -> None:
        if self.collective is not None:
            self.collective.close()
        self.tp.destroy()
