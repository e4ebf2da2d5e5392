"""RankWorker: one TP rank's model shard, memory pool, KV cache and fused-tail state: setup,
execution of step plans, sleep and wake. Its weight updates are in `worker_weights.py`, what
collective_rpc may call in `worker_rpc.py`.

Rank 0 also hosts the engine (see `engine_loop.py`): it broadcasts each step plan to the other
ranks over the CPU process group, so there is no per-step Ray call. The other ranks run
`follow()`, which executes whatever plan arrives until told to stop.

This class knows nothing about Ray: `rank_actor.py` adds the engine loop and an executor
(`ray_executor.py`, `mp_executor.py`, `uni_executor.py`) runs it.
"""

from __future__ import annotations

import socket
import threading
import time
from typing import NoReturn

import torch

from ..engine.plan import PlanCodec, StepPlan, encode_message
from ..engine_config import EngineConfig
from ..lifecycle import EngineStateError
from ..log import get_logger
from ..net import free_port
from ..parallel import TPGroup, set_cpu_threads
from .worker_rpc import RankRPC
from .worker_weights import RankWeights

log = get_logger("worker")


class RankWorker(RankWeights, RankRPC):
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
        self.plan_codec = PlanCodec()  # step plans as deltas: rank 0 encodes, the others decode
        self._fail_next_sleep = False
        self._follower_thread: threading.Thread | None = None
        self._probe_cv = threading.Condition()
        self._probe_results: list[dict] = []
        self._stale: set[str] = set()  # weights discarded by level 2 and not yet reloaded
        self.decode_graphs = None  # CUDA graphs of the decode step (model/cuda_graph.py)
        self.prefill_graphs = None  # piecewise graphs of the other steps (model/prefill_graphs.py)
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
            from ..model.cuda_graph import for_worker

            self.decode_graphs = for_worker(self.model, self.kv_caches, cfg)
            from ..model import prefill_graphs

            self.prefill_graphs = prefill_graphs.for_worker(self.model, cfg)
            try:
                prefill_graphs.warm_up_mixed_steps(self.execute, cfg)
            except Exception as e:  # an optimization: serve without it rather than not at all
                log.error("mixed_step_warm_up_failed", error=f"{type(e).__name__}: {e}"[:800])
            self._warm_up_cudnn()
        self.tp.barrier()
        info = {"rank": self.rank, "threads": threads, "seconds": round(time.perf_counter() - t0, 3),
                "tail": self.tail_summary()}
        log.info("rank_ready", **info)
        return info

    def _warm_up_cudnn(self) -> None:
        from ..model import sdpa
        from ..model.attention import MLAAttention

        attn = next((m for m in self.model.modules() if isinstance(m, MLAAttention)), None)
        if attn is not None and attn.v_dim < attn.qk_dim:
            t0 = time.perf_counter()
            sdpa.warm_up_cudnn(attn.num_heads, attn.qk_dim, attn.v_dim, self.config.torch_dtype, self.device)
            log.info("cudnn_warmed_up", seconds=round(time.perf_counter() - t0, 2))

    def _build_model(self, group_name: str) -> None:
        from ..memory.pool import MemoryPool
        from ..model.model import CausalLM
        from ..tail.base import TailRunner

        cfg = self.config
        mcfg = cfg.model_config
        # The pool exists before the model so the tail's flags and peer table are named state in it.
        self.pool = MemoryPool(self.device, layout=cfg.pool_layout, poison=cfg.poison_discarded)
        if self.tp.shm is not None:  # exchange memory outside the pool: kept by every sleep level
            self.pool.register_comm("tp_collectives", self.tp.shm.nbytes)
        self.collective = self._make_collective(group_name)
        self.tp.device_comm = self._make_device_comm(group_name)
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
            from ..tail.triton_tail import TritonTailCollective as Collective
        else:
            from ..tail.shm import ShmTailCollective as Collective
        return Collective(
            self.rank, self.world_size, max_tokens=cfg.fused_tail_max_tokens,
            latent_dim=mcfg.moe_latent_size, hidden_dim=mcfg.hidden_size, dtype=cfg.torch_dtype,
            state_alloc=self.pool.state, group_name=group_name, deadline_s=cfg.tail_deadline_s,
            barrier=self.tp.barrier,
        )

    def _make_device_comm(self, group_name: str):
        """Capturable device all-reduce/all-gather (tail/device_comm.py) for CUDA decode steps of
        ranks on one node, sized for the largest decode graph; None keeps torch.distributed."""
        cfg = self.config
        if self.device.type != "cuda" or self.world_size == 1 or not self.same_node:
            return None
        from ..tail import device_comm

        if not device_comm.enabled():
            return None
        mcfg = cfg.model_config
        rows = max([b for b in cfg.cuda_graph_batch_sizes if b <= cfg.max_num_seqs], default=1)
        widths = device_comm.channel_widths(cfg.torch_dtype, mcfg.hidden_size, mcfg.vocab_size, self.world_size)
        return device_comm.DeviceCollectives.create(
            self.rank, self.world_size, max_tokens=rows, widths=widths, state_alloc=self.pool.state,
            group_name=group_name, deadline_s=cfg.tail_deadline_s, barrier=self.tp.barrier, device=self.device)

    def _load_initial_weights(self) -> None:
        from ..weights import checkpoint as weights

        cfg = self.config
        if cfg.checkpoint_dir:
            weights.load_checkpoint(self.model, cfg.model_config, self.tp, cfg.checkpoint_dir,
                                    progress=self.rank == 0)
        elif cfg.dummy_weights == "device":
            from ..weights.device_dummy import init_dummy_weights_on_device

            init_dummy_weights_on_device(self.model, cfg.model_config, seed=cfg.seed + self.rank)
        else:
            weights.init_dummy_weights(self.model, cfg.model_config, self.tp, seed=cfg.seed)
        self.pool.mark_weights_loaded()

    def _allocate_kv_cache(self) -> None:
        """One cache per layer, all under the kv_cache tag (level 1 and 2 release them alike): the
        paged compressed KV of an MLA layer, or a KDA layer's per-sequence state rows (one row per
        scheduler state slot: conv history and recurrent state)."""
        cfg = self.config
        mcfg = cfg.model_config
        # One block and one state row past what the engine hands out: the decode graphs' scratch,
        # where padding rows run (cuda_graph.scratch_indices).
        shape = (cfg.kv_blocks() + 1, cfg.block_size, mcfg.kv_cache_dim)
        self.kv_caches = []
        for i in range(mcfg.num_hidden_layers):
            if not mcfg.is_kda_layer(i):
                self.kv_caches.append(self.pool.allocate("kv_cache", f"kv_cache.{i}", shape, cfg.torch_dtype))
                continue
            from ..model.kda import KDAState, kda_state_shapes

            rows = {name: self.pool.allocate("kv_cache", f"kda_state.{i}.{name}", (cfg.max_num_seqs + 1, *row),
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

    def execute(self, plan: StepPlan, defer_checks: bool = False) -> torch.Tensor | None:
        with self._exec_lock, torch.inference_mode():
            if self.decode_graphs is not None:
                logits = self.decode_graphs.run(plan.chunks, check=not defer_checks)
                if logits is not None:
                    return logits
            return self._eager_forward(plan.chunks, self.kv_caches)

    def _eager_forward(self, chunks: list, kv_caches: list | None) -> torch.Tensor | None:
        """Logits of the chunks that need them (None if none do); kv_caches=None: cache-less."""
        from ..model.attn_metadata import AttnMetadata

        meta = AttnMetadata.build(chunks, self.config.block_size, self.device)
        ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.long, device=self.device)
        hidden = None
        if self.prefill_graphs is not None and kv_caches is not None:
            hidden = self.prefill_graphs.forward(ids, meta, kv_caches)
        if hidden is None:
            hidden = self.model(ids, meta, kv_caches)
        if meta.logits_indices.numel() == 0:
            return None
        return self.model.compute_logits(hidden[meta.logits_indices])

    def execute_step(self, plan: StepPlan) -> torch.Tensor | None:
        """Rank 0: send the plan to every rank, then run it here too."""
        self.check_runnable()
        self.collect_step()
        # TP 1 has no followers: the plan's binary form is not built. Encoded inside _lead, after
        # any recovery there, which resets what the codec assumes the followers hold.
        message = (lambda: self.plan_codec.encode(plan)) if self.world_size > 1 else None
        # Overlapped (async output), the engine reads the collectives' errors in collect_step.
        return self._lead(message, lambda: self.execute(plan, defer_checks=self.config.overlap_outputs))

    def prepare_step(self, plan: StepPlan) -> None:
        """Rank 0, overlapped: pack a decode step scheduled ahead into the graphs' staging buffer,
        all but its token ids, while the step before it runs (`DecodeInputs.prepare`)."""
        if self.decode_graphs is not None:
            with self._exec_lock:
                self.decode_graphs.prepare(plan.chunks)

    def collect_step(self) -> None:
        """Rank 0, before its logits are read: raise (every rank re-armed) if a collective of the
        last replay gave up. A no-op unless execute_step deferred the check."""
        graphs = self.decode_graphs
        if graphs is None or not graphs.unchecked:
            return
        with self._plan_lock:
            try:
                graphs.check()
            except Exception as e:
                self._raise_recovered(e)

    def _lead(self, message, run):
        """Rank 0: broadcast a plan or probe, then run it. A failure on any rank re-arms every
        rank (recovery.py) before this raises, so the next plan runs on a clean TP group and tail."""
        with self._plan_lock:  # plans and probes reach the followers in one order
            shm = self.tp.shm
            if shm is not None and shm.resync_requested():  # a follower failed after the last plan
                self._recover(None)
                self.check_runnable()
            try:
                self.tp.broadcast_ints(message() if callable(message) else message)
                return run()
            except Exception as e:
                self._raise_recovered(e)

    def _raise_recovered(self, error: Exception) -> NoReturn:
        """Re-arm every rank after this rank's failed step, then raise what the step should raise."""
        err = self._recover(error)
        if err is error:
            raise error
        raise err from error

    def _recover(self, error: Exception | None):
        from .recovery import recover

        return recover(self, error)

    def follow(self) -> None:
        """Ranks > 0: execute broadcast plans until a stop message. A failed step (here or on a
        peer) is recovered from in place (recovery.py); rank 0 reports the error to clients."""
        while True:
            try:
                kind, payload = self.plan_codec.decode(self.tp.broadcast_ints(None, wait_forever=True))
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

    def shutdown(self) -> None:
        if self.collective is not None:
            self.collective.close()
        self.tp.destroy()
        self._release_memory()

    def _release_memory(self) -> None:
        """Give the pool's chunks back. A CUDA chunk is cuMem memory, which no finalizer frees: an
        engine in this process (the 'uni' executor: RLHF colocated with its trainer, the bench's
        builds) kept all its weights and caches after shutdown, and run 51's fifth build on an
        80 GB H100 ran out of memory. The graphs and the model go first: nothing may replay or
        read the unmapped addresses. A step still running after 5 s (a rank stuck in a collective)
        keeps the memory: a shutdown must not hang on it, nor unmap memory under it."""
        if not self._exec_lock.acquire(timeout=5.0):
            log.warning("shutdown_memory_kept", rank=self.rank, reason="a step is still running")
            return
        try:
            self.decode_graphs = self.prefill_graphs = None
            self.model, self.kv_caches = None, []
            if self.pool is not None:
                self.pool.close()
        finally:
            self._exec_lock.release()
