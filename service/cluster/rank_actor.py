"""RankActor: a RankWorker plus, on rank 0, the engine loop. Free of Ray so it also runs in-process.

Under Ray each method runs on its own actor thread (max_concurrency), so control calls
(sleep, wake, diagnostics) are served while the engine loop or the follower loop runs.
"""

from __future__ import annotations

import gc
import threading

from ..engine_config import EngineConfig
from ..outputs import OutputBatch
from .worker import RankWorker


class RankActor(RankWorker):
    """RankWorker plus the engine loop on rank 0 (Ray runs each method on its own thread)."""

    def __init__(self, rank: int, config: EngineConfig):
        super().__init__(rank, config)
        self.loop = None
        self._stopped = threading.Event()

    def start(self) -> None:
        self._freeze_gc()
        if self.rank != 0:
            self.start_following()
            return
        from ..engine.llm_engine import LLMEngine
        from ..tokenizer import get_tokenizer
        from .engine_loop import EngineLoop

        cfg = self.config
        tokenizer = get_tokenizer(cfg.model, cfg.model_config)
        engine = LLMEngine(
            self.execute_step, tokenizer, block_size=cfg.block_size, num_blocks=cfg.kv_blocks(),
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            max_model_len=cfg.max_model_len, eos_token_id=cfg.model_config.eos_token_id,
            vocab_size=cfg.model_config.vocab_size, overlap=cfg.overlap_outputs, collect=self.collect_step,
            prepare=self.prepare_step,
        )
        self.loop = EngineLoop(engine, lambda: self.weight_version, self.refusal)

    @staticmethod
    def _freeze_gc() -> None:
        """Take what startup left alive (modules, parameters, imports) out of the cyclic GC's
        scans, as vLLM's engine core does (`freeze_gc_heap`): its full collections otherwise walk
        all of it every few hundred decode steps (6-9% of a TP 1 step's CPU samples,
        bench/RESULTS.md 2026-12-03). `stop` unfreezes, so an in-process engine's objects can be
        collected again."""
        gc.collect()
        gc.freeze()

    # engine-loop passthroughs (rank 0 only)
    def add_request(self, request_id, prompt, prompt_token_ids, params) -> None:
        self.loop.add(request_id, prompt, prompt_token_ids, params)

    def abort(self, request_ids) -> None:
        self.loop.abort(request_ids)

    def poll(self, timeout: float = 1.0) -> OutputBatch:
        return OutputBatch(self.loop.poll(timeout))

    def generate(self, requests, timeout=None):
        return self.loop.generate(requests, timeout)

    def pause(self, mode: str = "wait", timeout: float = 60.0) -> dict:
        return self.loop.pause(mode, timeout)

    def resume(self) -> None:
        self.loop.resume()

    def engine_stats(self) -> dict:
        return self.loop.stats()

    def tokenizer_info(self) -> dict:
        tok = self.loop.engine.tokenizer
        return {"has_tokenizer": tok is not None}

    def encode(self, text: str) -> list[int]:
        return self.loop.engine.tokenizer.encode(text)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return self.loop.engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)

    def park(self, timeout: float = 3600.0) -> bool:
        """Block until this rank stops (True) or `timeout` passes (False). The controller keeps
        one such call open per rank, so a rank's death fails it at once instead of waiting for
        the next health ping."""
        return self._stopped.wait(timeout)

    def stop(self) -> None:
        self._stopped.set()
        if self.loop is not None:
            self.loop.stop()
            self.stop_followers()
        self.shutdown()
        gc.unfreeze()
