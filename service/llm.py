"""Offline API mirroring vLLM's `LLM`: generate, sleep/wake_up, weight updates, collective_rpc."""

from __future__ import annotations

import itertools
from typing import Any

from .engine_config import EngineConfig
from .outputs import RequestOutput
from .sampling_params import InvalidRequest, SamplingParams

_TAGS = ("weights", "kv_cache")


class SleepError(RuntimeError):
    """A sleep or wake failed on some rank; the message lists every rank's outcome."""

    def __init__(self, message: str, outcomes: list[dict]):
        super().__init__(message)
        self.outcomes = outcomes


def make_executor(config: EngineConfig, backend: str):
    """'ray' (the product: one actor per rank), 'mp' (one process per rank on this machine, no
    Ray) or 'uni' (TP 1 in this process: tools, the GPU box)."""
    if backend == "ray":
        from .executor import RayExecutor

        return RayExecutor(config)
    if backend == "mp":
        from .mp_executor import MpExecutor

        return MpExecutor(config)
    if backend == "uni":
        from .local import UniExecutor

        return UniExecutor(config)
    raise ValueError(f"distributed_executor_backend must be 'ray', 'mp' or 'uni', got {backend!r}")


class LLM:
    def __init__(self, model: str = "tiny", tensor_parallel_size: int = 1, dtype: str = "auto", seed: int = 0,
                 hf_overrides: dict[str, Any] | None = None, enable_sleep_mode: bool = False,
                 sleep_preserve_parameter_names: list[str] | None = None, fused_tail: str = "auto",
                 distributed_executor_backend: str = "ray", **kwargs):
        self.config = EngineConfig(
            model=model, tensor_parallel_size=tensor_parallel_size, dtype=dtype, seed=seed,
            hf_overrides=hf_overrides, enable_sleep_mode=enable_sleep_mode,
            sleep_preserve_parameter_names=list(sleep_preserve_parameter_names or []),
            fused_tail=fused_tail, **kwargs,
        ).resolve()
        self.executor = make_executor(self.config, distributed_executor_backend)
        self._ids = itertools.count()
        self.weight_version = 0

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

    # ---- sleep -----------------------------------------------------------------
    def sleep(self, level: int = 1) -> list[dict]:
        if level not in (0, 1, 2):
            raise ValueError(f"sleep level must be 0, 1 or 2, got {level}")
        if level > 0 and not self.config.enable_sleep_mode:
            raise RuntimeError("sleep mode is off: create the LLM with enable_sleep_mode=True")
        self.executor.rank0_call("pause", "wait")
        if level == 0:
            return [{"rank": r, "level": 0} for r in range(self.config.tensor_parallel_size)]
        outcomes = self.executor.call_all("sleep", level)
        if all(o["ok"] for o in outcomes):
            return [o["result"] for o in outcomes]
        # Never leave the cluster half asleep: wake the ranks that did sleep (a no-op on the
        # others) and serve again. Weights a level-2 sleep discarded stay marked stale.
        woke = self.executor.call_all("wake_up", list(_TAGS))
        rolled_back = all(o["ok"] for o in woke)
        if rolled_back:
            self.executor.rank0_call("resume")
        failed = "; ".join(o["error"] for o in outcomes if not o["ok"])
        state = "rolled back: every rank is awake" if rolled_back else "rollback failed on some ranks"
        raise SleepError(f"sleep failed ({state}): {failed}", outcomes + [{"rollback": w} for w in woke])

    def wake_up(self, tags: list[str] | None = None) -> list[dict]:
        tags = list(tags) if tags else list(_TAGS)
        bad = [t for t in tags if t not in _TAGS]
        if bad:
            raise ValueError(f"unknown wake_up tags {bad}; known: {list(_TAGS)}")
        reports = self._all_or_error("wake_up", tags)
        epochs = {str(r.get("tail_epochs")) for r in reports}
        if len(epochs) > 1:
            raise SleepError(f"ranks disagree on tail epochs after wake: {sorted(epochs)}", reports)
        if not self.is_sleeping():
            self.executor.rank0_call("resume")
        return reports

    def is_sleeping(self) -> bool:
        return any(s["asleep"] for s in self.executor.collective_rpc("status"))

    def _all_or_error(self, method: str, *args) -> list[dict]:
        outcomes = self.executor.call_all(method, *args)
        if all(o["ok"] for o in outcomes):
            return [o["result"] for o in outcomes]
        raise SleepError(f"{method} failed: " + "; ".join(o["error"] for o in outcomes if not o["ok"]), outcomes)

    # ---- weights -----------------------------------------------------------------
    def update_weights_from_path(self, path: str) -> int:
        version = self.weight_version + 1
        self._all_or_error("update_weights_from_path", path, version)
        self.weight_version = version
        return version

    def update_weights(self, named_tensors) -> int:
        """Full HF-named tensors (e.g. from a trainer); each rank keeps its slices."""
        version = self.weight_version + 1
        ref = self.executor.put(list(named_tensors))
        self._all_or_error("update_weights_from_tensors", ref, version)
        self.weight_version = version
        return version

    # ---- diagnostics -----------------------------------------------------------------
    def collective_rpc(self, method: str, *args, **kwargs) -> list:
        return self.executor.collective_rpc(method, *args, **kwargs)

    def shutdown(self) -> None:
        self.executor.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shutdown()
