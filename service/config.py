"""Model configuration: Hugging Face DeepseekV3Config keys plus the latent-MoE keys.

`ModelConfig` is a plain dataclass whose field names are the config.json keys, so a
checkpoint's config.json loads with `ModelConfig.from_dict` and `to_dict` writes one that
transformers' DeepseekV3 reads (when the latent MoE is off).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A model or engine configuration that cannot work, with the reason."""


@dataclass
class ModelConfig:
    vocab_size: int = 1024
    hidden_size: int = 128
    intermediate_size: int = 256
    num_hidden_layers: int = 4
    first_k_dense_replace: int = 1
    num_attention_heads: int = 8
    num_key_value_heads: int = 8
    q_lora_rank: int | None = 64
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6
    n_routed_experts: int = 16
    num_experts_per_tok: int = 4
    n_shared_experts: int = 1
    moe_intermediate_size: int = 32
    n_group: int = 4
    topk_group: int = 2
    routed_scaling_factor: float = 2.5
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    norm_topk_prob: bool = True
    tie_word_embeddings: bool = False
    moe_latent_size: int | None = 64
    latent_moe_use_norm: bool = True
    max_position_embeddings: int = 2048
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    attention_bias: bool = False
    bos_token_id: int = 0
    eos_token_id: int = 1
    rope_interleave: bool = True
    torch_dtype: str | None = None
    # Keys we carry through unchanged (e.g. rope_scaling) so a round trip loses nothing.
    extra: dict[str, Any] = field(default_factory=dict)

    # ---- derived -------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Per token per layer, MLA caches the compressed KV plus the shared rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def is_latent(self) -> bool:
        return self.moe_latent_size is not None

    def is_moe_layer(self, layer_idx: int) -> bool:
        return self.n_routed_experts > 0 and layer_idx >= self.first_k_dense_replace

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    # ---- validation ----------------------------------------------------------
    def validate(self, tp: int = 1) -> None:
        if self.scoring_func != "sigmoid":
            raise ConfigError(f"scoring_func={self.scoring_func!r}: only 'sigmoid' is supported")
        if self.topk_method not in ("noaux_tc", "greedy", "group_limited_greedy"):
            raise ConfigError(f"topk_method={self.topk_method!r} is not supported")
        if self.n_routed_experts % max(self.n_group, 1):
            raise ConfigError(f"n_routed_experts={self.n_routed_experts} not divisible by n_group={self.n_group}")
        if self.topk_group > max(self.n_group, 1):
            raise ConfigError(f"topk_group={self.topk_group} > n_group={self.n_group}")
        if tp < 1:
            raise ConfigError(f"tensor_parallel_size must be >= 1, got {tp}")
        checks = {
            "num_attention_heads": self.num_attention_heads,
            "intermediate_size": self.intermediate_size,
            "moe_intermediate_size": self.moe_intermediate_size,
            "hidden_size": self.hidden_size,
            "vocab_size": self.vocab_size,
        }
        if self.n_shared_experts:
            checks["n_shared_experts * moe_intermediate_size"] = self.n_shared_experts * self.moe_intermediate_size
        for name, value in checks.items():
            if value % tp:
                raise ConfigError(f"tensor_parallel_size={tp} does not divide {name}={value}")

    # ---- (de)serialisation -----------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names and k != "extra"}
        extra.update(d.get("extra", {}))
        # A plain DeepSeek-V3 config.json has no moe_latent_size: it is not a latent model,
        # whatever the dataclass default (which the tiny presets rely on) says.
        known.setdefault("moe_latent_size", None)
        cfg = cls(**known)
        cfg.extra = extra
        return cfg

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        d.update(self.extra)
        d["model_type"] = "deepseek_v3"
        d["architectures"] = ["KimiK3ForCausalLM" if self.is_latent else "DeepseekV3ForCausalLM"]
        d.setdefault("rope_scaling", None)
        return d

    def with_overrides(self, overrides: dict[str, Any] | None) -> ModelConfig:
        if not overrides:
            return self
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ConfigError(f"hf_overrides has unknown keys: {unknown}")
        return dataclasses.replace(self, **overrides)

    def save(self, directory: str) -> None:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)

    @classmethod
    def load(cls, directory: str) -> ModelConfig:
        path = os.path.join(directory, "config.json")
        if not os.path.exists(path):
            raise ConfigError(f"{directory!r} has no config.json")
        with open(path) as f:
            return cls.from_dict(json.load(f))


_TINY = ModelConfig()

PRESETS: dict[str, ModelConfig] = {
    # CI-sized, latent MoE on; every width divides TP 8.
    "tiny": _TINY,
    # The same with the latent MoE off: plain DeepSeek-V3 MoE, loadable by transformers.
    "tiny-dense-moe": dataclasses.replace(_TINY, moe_latent_size=None),
    # A few GB in bf16, for benchmarks.
    "small": ModelConfig(
        vocab_size=32768, hidden_size=2048, intermediate_size=5632, num_hidden_layers=12,
        first_k_dense_replace=1, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=768,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=64, num_experts_per_tok=8, n_shared_experts=1, moe_intermediate_size=768,
        n_group=8, topk_group=4, moe_latent_size=1024, max_position_embeddings=8192,
    ),
    # Real Kimi-K3 dimensions: for shape and memory planning, not run on CPU.
    "k3": ModelConfig(
        vocab_size=163840, hidden_size=7168, intermediate_size=18432, num_hidden_layers=61,
        first_k_dense_replace=1, num_attention_heads=64, num_key_value_heads=64, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=896, num_experts_per_tok=16, n_shared_experts=2, moe_intermediate_size=3072,
        n_group=1, topk_group=1, routed_scaling_factor=2.827, moe_latent_size=3584,
        max_position_embeddings=131072, rope_theta=50000.0,
    ),
}


def resolve_model(model: str, hf_overrides: dict[str, Any] | None = None) -> tuple[ModelConfig, str | None]:
    """`model` is a preset name or a checkpoint directory. Returns (config, checkpoint_dir or None)."""
    if model in PRESETS:
        return PRESETS[model].with_overrides(hf_overrides), None
    if os.path.isdir(model):
        return ModelConfig.load(model).with_overrides(hf_overrides), model
    raise ConfigError(f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint directory")


def parameter_count(cfg: ModelConfig) -> int:
    """Logical parameter count (all ranks together), for memory planning."""
    h, v = cfg.hidden_size, cfg.vocab_size
    qk, n = cfg.qk_head_dim, cfg.num_attention_heads
    attn = (h * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * n * qk) if cfg.q_lora_rank else h * n * qk
    attn += h * cfg.kv_cache_dim + cfg.kv_lora_rank + cfg.kv_lora_rank * n * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    attn += n * cfg.v_head_dim * h
    total = v * h * (1 if cfg.tie_word_embeddings else 2) + h
    for i in range(cfg.num_hidden_layers):
        total += attn + 2 * h
        if not cfg.is_moe_layer(i):
            total += 3 * h * cfg.intermediate_size
            continue
        width = cfg.moe_latent_size or h
        total += cfg.n_routed_experts * 3 * width * cfg.moe_intermediate_size
        total += cfg.n_routed_experts * (h + 1)  # router weight and e_score_correction_bias
        total += 3 * h * cfg.moe_intermediate_size * cfg.n_shared_experts
        if cfg.is_latent:
            total += 2 * h * cfg.moe_latent_size + (cfg.moe_latent_size if cfg.latent_moe_use_norm else 0)
    return total
