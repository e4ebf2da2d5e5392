"""Offline API mirroring vLLM's `LLM`: generate, sleep/wake_up, weight updates, collective_rpc.

Sleep, wake, weight updates, pause/resume and restart go through the same `Coordinator` as the
HTTP API (cluster/coordinator.py): the same rollback, deadlines and per-rank reports on every executor.
"""

from __future__ import annotations

import itertools
from typing import Any

from .cluster.backends import make_executor
from .cluster.coordinator import Coordinator, load_tensors
from .engine_config import EngineConfig
from .lifecycle import CoordinationError
from .outputs import RequestOutput
from .sampling_params import InvalidRequest, SamplingParams

# A sleep, wake or weight update that failed on some rank: the message names every rank that
# failed, `.outcomes` lists every rank's outcome (the coordinator's error under its offline name).
SleepError = CoordinationError

__all__ = ["LLM", "SleepError", "make_executor"]


class LLM:
    def __init__(self, model: str = "tiny", tensor_parallel_size: int = 1, dtype: str = "auto", seed: int = 0,
                 hf_overrides: dict[str, Any] | None = None, enable_sleep_mode: bool = False,
                 sleep_preserve_parameter_names: list[str] | None = None, fused_tail: str = "auto",
                 distributed_executor_backend: str = "ray", weight_snapshot: str = "off", **kwargs):
        self.config = EngineConfig(
            model=model, tensor_parallel_size=tensor_parallel_size, dtype=dtype, seed=seed,
            hf_overrides=hf_overrides, enable_sleep_mode=enable_sleep_mode,
            sleep_preserve_parameter_names=list(sleep_preserve_parameter_names or []),
            fused_tail=fused_tail, **kwargs,
        ).resolve()
        self.backend = distributed_executor_backend
        executor = make_executor(self.config, distributed_executor_backend)
        self.coordinator = Coordinator(executor, sleep_enabled=self.config.enable_sleep_mode, hints="offline",
                                       weight_snapshot=weight_snapshot)
        self.coordinator.weight_sources["tensors"] = load_tensors
        self._ids = itertools.count()

    @property
    def executor(self):
        """The ranks (replaced by `restart`)."""
        return self.coordinator.executor

    @property
    def weight_version(self) -> int:
        return self.coordinator.state.weight_version

    # ---- generation -----------------------------------------------------------------
    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 timeout: float | None = None) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise InvalidRequest("sampling_params list must have one entry per prompt")
        requests = []
        for prompt, p in zip(prompts, params_list):
            rid = f"offline-{next(self._ids)}"
            if isinstance(prompt, str):
                requests.append((rid, prompt, None, p))
            elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
                requests.append((rid, prompt.get("prompt"), list(prompt["prompt_token_ids"]), p))
            else:
                raise InvalidRequest("a prompt is a string or {'prompt_token_ids': [...]}")
        return self.executor.rank0_call("generate", requests, timeout)

    # ---- lifecycle: the coordinator's transitions -------------------------------------
    def sleep(self, level: int = 1, mode: str = "wait") -> list[dict]:
        """Every rank to sleep `level`; one report per rank. Asleep already: the ranks report a
        no-op. A failure on any rank is rolled back (no rank stays asleep) and raised."""
        return _results(self.coordinator.sleep(level, mode, again=True))

    def wake_up(self, tags: list[str] | None = None) -> list[dict]:
        """Wake `tags` (default all) on every rank; one report per rank."""
        return _results(self.coordinator.wake_up(tags))

    def is_sleeping(self) -> bool:
        """Whether any rank reports a tag asleep (asked of the ranks, not the coordinator)."""
        return any(s["asleep"] for s in self.executor.collective_rpc("status"))

    def pause(self, mode: str = "keep") -> dict:
        """Stop the engine between steps (mode: abort, wait for or keep the requests in flight)."""
        return self.coordinator.pause(mode)

    def resume(self) -> dict:
        return self.coordinator.resume()

    def update_weights_from_path(self, path: str) -> int:
        return self.coordinator.update_weights({"path": path})["weight_version"]

    def update_weights(self, named_tensors) -> int:
        """Full HF-named tensors (e.g. from a trainer); each rank keeps its slices."""
        return self.coordinator.update_weights({"tensors": named_tensors})["weight_version"]

    def restart(self) -> dict:
        """New ranks with the served weights and version (the last path update; tensor updates
        too with weight_snapshot='host'), e.g. after a rank died or the model was marked failed."""
        return self.coordinator.restart(lambda: make_executor(self.config, self.backend))

    def status(self) -> dict:
        """The coordinator's state and every rank's own status report."""
        return {**self.coordinator.snapshot(), "ranks": self.executor.call_all("collective_rpc", "status")}

    # ---- diagnostics -----------------------------------------------------------------
    def collective_rpc(self, method: str, *args, **kwargs) -> list:
        return self.executor.collective_rpc(method, *args, **kwargs)

    def shutdown(self) -> None:
        self.executor.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()


def _results(answer: dict) -> list[dict]:
    return [o["result"] for o in answer["ranks"]]
