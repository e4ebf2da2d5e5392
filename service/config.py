"""Model configuration for both families we serve:

- DeepSeek-V3 (`model_type: deepseek_v3`): field names are Hugging Face `DeepseekV3Config` keys,
  plus our latent-MoE keys (`moe_latent_size`, `latent_moe_use_norm`).
- Kimi-Linear / Kimi-K3 (`model_type: kimi_linear`, or `kimi_k3` wrapping one as `text_config`),
  as vLLM's `KimiLinearConfig` defines it: KDA and MLA layers, latent MoE under
  `routed_expert_hidden_size`, SiTU, attention residuals. Its MoE keys are renamed to the
  DeepSeek field names on load (`num_experts` -> `n_routed_experts`, ...) and back on save, so
  the model code reads one set of names.
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
    # ---- Kimi-Linear / Kimi-K3 (their defaults leave a DeepSeek-V3 model unchanged) ----------
    model_type: str = "deepseek_v3"  # or "kimi_linear"
    # {"kda_layers": [...], "full_attn_layers": [...] (1-based layer numbers), "num_heads",
    #  "head_dim", "short_conv_kernel_size", "use_full_rank_gate", "gate_lower_bound"}
    linear_attn_config: dict | None = None
    mla_use_nope: bool = False  # MLA without rotary embedding (Kimi's MLA layers)
    mla_use_output_gate: bool = False  # attention output * sigmoid(g_proj(x)) before o_proj
    attn_res_block_size: int | None = None  # attention residuals over blocks of this many layers
    activation_situ_beta: float | None = None
    activation_situ_linear_beta: float | None = None
    num_nextn_predict_layers: int = 0  # MTP layers: loaded names are accepted and ignored
    moe_layer_freq: int = 1
    # The outer config of a kimi_k3 checkpoint (vision tower and all) without its text_config:
    # its weights carry a `language_model.` prefix and a request with images is refused.
    multimodal_wrapper: dict | None = None
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

    @property
    def is_kimi(self) -> bool:
        return self.model_type == "kimi_linear"

    def is_moe_layer(self, layer_idx: int) -> bool:
        return (self.n_routed_experts > 0 and layer_idx >= self.first_k_dense_replace
                and layer_idx % max(self.moe_layer_freq, 1) == 0)

    def is_kda_layer(self, layer_idx: int) -> bool:
        """KDA (linear attention) or MLA; the config's layer lists count from 1."""
        return self.linear_attn_config is not None and (layer_idx + 1) in self.linear_attn_config["kda_layers"]

    @property
    def kda_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_kda_layer(i)]

    @property
    def mla_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if not self.is_kda_layer(i)]

    @property
    def kda_num_heads(self) -> int:
        return int(self.linear_attn_config["num_heads"])

    @property
    def kda_head_dim(self) -> int:
        return int(self.linear_attn_config["head_dim"])

    @property
    def kda_conv_size(self) -> int:
        return int(self.linear_attn_config.get("short_conv_kernel_size", 4))

    @property
    def kda_full_rank_gate(self) -> bool:
        """Kimi-K3's output gate g_proj [H*D, hidden]; Kimi-Linear's is low-rank g_a/g_b."""
        return bool(self.linear_attn_config.get("use_full_rank_gate", False))

    @property
    def kda_gate_lower_bound(self) -> float | None:
        return self.linear_attn_config.get("gate_lower_bound")

    @property
    def latent_norm_eps(self) -> float:
        """eps of q_a_layernorm/kv_a_layernorm: transformers' DeepSeek-V3 builds them with RMSNorm's
        default 1e-6, vLLM's Kimi MLA with rms_norm_eps."""
        return self.rms_norm_eps if self.is_kimi else 1e-6

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    # ---- validation ----------------------------------------------------------
    def validate(self, tp: int = 1) -> None:
        if self.model_type not in ("deepseek_v3", "kimi_linear"):
            raise ConfigError(f"model_type={self.model_type!r}: only deepseek_v3, kimi_linear and kimi_k3 are supported")
        if self.hidden_act not in ("silu", "situ"):
            raise ConfigError(f"hidden_act={self.hidden_act!r}: only 'silu' and 'situ' are supported")
        if self.scoring_func not in ("sigmoid", "softmax"):
            key = "moe_router_activation_func" if self.is_kimi else "scoring_func"
            raise ConfigError(f"{key}={self.scoring_func!r}: only 'sigmoid' and 'softmax' are supported")
        self._validate_kimi(tp)
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
        if self.linear_attn_config is not None and self.kda_layers:
            checks["linear_attn_config.num_heads"] = self.kda_num_heads
        for name, value in checks.items():
            if value % tp:
                raise ConfigError(f"tensor_parallel_size={tp} does not divide {name}={value}")

    def _validate_kimi(self, tp: int) -> None:
        if self.attn_res_block_size is not None and self.attn_res_block_size < 1:
            raise ConfigError(f"attn_res_block_size={self.attn_res_block_size} must be >= 1")
        lac = self.linear_attn_config
        if lac is None:
            return
        for key in ("kda_layers", "full_attn_layers"):
            if not isinstance(lac.get(key), list):
                raise ConfigError(f"linear_attn_config.{key} must be a list of layer numbers (1-based)")
        kda, full = set(lac["kda_layers"]), set(lac["full_attn_layers"])
        layers = range(1, self.num_hidden_layers + 1)
        both = sorted(n for n in layers if n in kda and n in full)
        neither = sorted(n for n in layers if n not in kda and n not in full)
        if both or neither:
            raise ConfigError(
                "linear_attn_config.kda_layers and linear_attn_config.full_attn_layers must name each of the "
                f"layers 1..{self.num_hidden_layers} exactly once"
                + (f"; in both: {both}" if both else "") + (f"; in neither: {neither}" if neither else ""))
        if kda & set(layers):
            for key in ("num_heads", "head_dim"):
                if not isinstance(lac.get(key), int) or lac[key] < 1:
                    raise ConfigError(f"linear_attn_config.{key} must be a positive integer, got {lac.get(key)!r}")

    # ---- (de)serialisation -----------------------------------------------------
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        wrapper = None
        if d.get("model_type") == "kimi_k3":
            if not isinstance(d.get("text_config"), dict):
                raise ConfigError("a kimi_k3 config needs a text_config (a kimi_linear config)")
            wrapper = {k: v for k, v in d.items() if k not in ("text_config", "model_type", "architectures")}
            d = dict(d["text_config"])
            d.setdefault("model_type", "kimi_linear")
        if d.get("model_type") == "kimi_linear":
            d = _from_kimi_keys(d)
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names and k != "extra"}
        extra.update(d.get("extra", {}))
        extra.pop("architectures", None)  # derived again by to_dict
        # A plain DeepSeek-V3 config.json has no moe_latent_size: it is not a latent model,
        # whatever the dataclass default (which the tiny presets rely on) says.
        known.setdefault("moe_latent_size", None)
        known.setdefault("model_type", "deepseek_v3")
        if wrapper is not None:
            known["multimodal_wrapper"] = wrapper
        cfg = cls(**known)
        cfg.extra = extra
        return cfg

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
             if f.name not in ("extra", "multimodal_wrapper")}
        d.update(self.extra)
        if self.is_kimi:
            text = _to_kimi_keys(d)
            if self.multimodal_wrapper is None:
                return text
            return {**self.multimodal_wrapper, "model_type": "kimi_k3",
                    "architectures": ["KimiK3ForConditionalGeneration"], "text_config": text}
        for key in _KIMI_ONLY:
            d.pop(key)
        d["architectures"] = ["KimiK3ForCausalLM" if self.is_latent else "DeepseekV3ForCausalLM"]
        d.setdefault("rope_scaling", None)
        return d

    def with_overrides(self, overrides: dict[str, Any] | None) -> ModelConfig:
        """hf_overrides in our field names or, for Kimi models, in KimiLinearConfig's; a kimi_k3
        model also takes them nested under `text_config`, as vLLM does."""
        if not overrides:
            return self
        overrides = dict(overrides)
        if isinstance(overrides.get("text_config"), dict):
            overrides.update(overrides.pop("text_config"))
        if self.is_kimi:
            overrides = {_KIMI_TO_OURS.get(k, k): v for k, v in overrides.items()}
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


# KimiLinearConfig key -> our field. Values are unchanged except where noted in _from_kimi_keys.
_KIMI_TO_OURS = {
    "num_experts": "n_routed_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_shared_experts": "n_shared_experts",
    "moe_renormalize": "norm_topk_prob",
    "num_expert_group": "n_group",
    "moe_router_activation_func": "scoring_func",
    "routed_expert_hidden_size": "moe_latent_size",
}
_OURS_TO_KIMI = {v: k for k, v in _KIMI_TO_OURS.items()}
# KimiLinearConfig's defaults for the keys whose defaults differ from ours (its __init__).
_KIMI_DEFAULTS = {
    "first_k_dense_replace": 0, "num_shared_experts": 0, "routed_scaling_factor": 1.0, "q_lora_rank": None,
    "latent_moe_use_norm": False, "num_expert_group": 1, "topk_group": 1, "bos_token_id": 1, "eos_token_id": 2,
    "max_position_embeddings": 4096, "routed_expert_hidden_size": None, "moe_router_activation_func": "sigmoid",
    "moe_renormalize": True, "num_experts": None, "rope_interleave": False,
    # KimiLinearConfig says False, but vLLM's Kimi MLA asserts True and transformers' KimiLinear
    # never applies rope (nor writes the key): NoPE is the only reading that runs anywhere.
    "mla_use_nope": True,
}
# Our fields that only a Kimi config.json carries.
_KIMI_ONLY = ("model_type", "linear_attn_config", "mla_use_nope", "mla_use_output_gate", "attn_res_block_size",
              "activation_situ_beta", "activation_situ_linear_beta", "num_nextn_predict_layers", "moe_layer_freq")


def _from_kimi_keys(d: dict[str, Any]) -> dict[str, Any]:
    if "max_position_embeddings" not in d and "model_max_length" in d:  # transformers' spelling
        d = {**d, "max_position_embeddings": d["model_max_length"]}
    d = {**_KIMI_DEFAULTS, **d}
    if d.get("num_experts") is None:  # not an MoE model: every layer runs the dense MLP
        d["num_experts"] = 0
    if d.pop("use_grouped_topk", True) is False:
        d["num_expert_group"], d["topk_group"] = 1, 1
    if "rope_parameters" not in d and "rope_theta" not in d and "rope_scaling" not in d:
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
    for ours in ("n_routed_experts", "num_experts_per_tok", "n_shared_experts", "norm_topk_prob", "n_group",
                 "moe_latent_size", "scoring_func"):
        d.pop(ours, None)  # transformers writes both spellings; the Kimi one is the source
    return {_KIMI_TO_OURS.get(k, k): v for k, v in d.items()}


def _to_kimi_keys(d: dict[str, Any]) -> dict[str, Any]:
    out = {_OURS_TO_KIMI.get(k, k): v for k, v in d.items()}
    out["model_type"] = "kimi_linear"
    out["architectures"] = ["KimiLinearForCausalLM"]
    if out.get("num_experts") == 0:
        out["num_experts"] = None
    return out


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
    # Kimi-K3 as vLLM defines it, CI-sized: KDA and MLA layers (3:1, as Kimi-Linear), latent MoE
    # with grouped routing, SiTU, attention residuals over blocks of 2 layers, MLA output gate
    # without rope, K3's full-rank KDA output gate; every width divides TP 8.
    "k3-tiny": ModelConfig(
        model_type="kimi_linear", vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        first_k_dense_replace=1, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=64, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16, num_experts_per_tok=4,
        n_shared_experts=1, moe_intermediate_size=32, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        moe_latent_size=64, latent_moe_use_norm=True, hidden_act="situ", activation_situ_beta=4.0,
        activation_situ_linear_beta=8.0, mla_use_nope=True, mla_use_output_gate=True, attn_res_block_size=2,
        linear_attn_config={"kda_layers": [1, 2, 3], "full_attn_layers": [4], "num_heads": 8, "head_dim": 16,
                            "short_conv_kernel_size": 4, "use_full_rank_gate": True},
        rope_interleave=False, num_nextn_predict_layers=1,
    ),
    # Real Kimi-K3 text dimensions (hidden 7168, latent 3584, 96 KDA heads of 128, MLA q_lora 1536,
    # as vLLM's K3 kernels are shaped): for shape and memory planning, not run on CPU.
    "k3": ModelConfig(
        model_type="kimi_linear", vocab_size=163840, hidden_size=7168, intermediate_size=18432,
        num_hidden_layers=61, first_k_dense_replace=1, num_attention_heads=96, num_key_value_heads=96,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_routed_experts=896, num_experts_per_tok=16, n_shared_experts=2, moe_intermediate_size=3072,
        n_group=1, topk_group=1, routed_scaling_factor=2.827, moe_latent_size=3584, latent_moe_use_norm=True,
        hidden_act="situ", activation_situ_beta=4.0, mla_use_nope=True, mla_use_output_gate=True,
        attn_res_block_size=8, max_position_embeddings=131072, rope_interleave=False, num_nextn_predict_layers=1,
        linear_attn_config={"kda_layers": [n for n in range(1, 62) if n % 4], "full_attn_layers": list(range(4, 62, 4)),
                            "num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                            "use_full_rank_gate": True},
    ),
}


def resolve_model(model: str, hf_overrides: dict[str, Any] | None = None) -> tuple[ModelConfig, str | None]:
    """`model` is a preset name or a checkpoint directory. Returns (config, checkpoint_dir or None)."""
    if model in PRESETS:
        return PRESETS[model].with_overrides(hf_overrides), None
    if os.path.isdir(model):
        return ModelConfig.load(model).with_overrides(hf_overrides), model
    raise ConfigError(f"model {model!r} is neither a preset ({', '.join(PRESETS)}) nor a checkpoint directory")

