"""The weight table: every logical tensor of the model in Hugging Face names (DeepSeek-V3's, or
Kimi's as vLLM reads them), its full shape, which model parameter holds it (an expert index into
the fused tensors for routed experts, a part of a stacked parameter) and along which dim TP
shards it; and the checks a checkpoint or a trainer's update passes before any weight changes.

Dummy init, checkpoint loading, trainer updates and export (checkpoint.py) all go through this
table and the same slicing code, so TP 1/2/4 hold the same logical model.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..config import ConfigError, ModelConfig
from ..parallel import TPGroup
from .fp8 import (
    SCALE_SUFFIX,
    fp8_block,
    held_fp8,
    is_fp8_dtype,
    is_fp8_weight,
    is_scale_dtype,
    layout_problems,
    scale_spec,
)

# Stored as float32 whatever the checkpoint dtype, as transformers and vLLM keep it.
FP32_SUFFIXES = ("e_score_correction_bias", "dt_bias", "A_log")
# A kimi_k3 checkpoint holds the text model under this prefix (vLLM also accepts
# `language_model.layers.`, without the `model.`), next to the vision tower we do not serve.
WRAPPER_PREFIX = "language_model."
_VISION_PREFIXES = ("vision_tower.", "mm_projector.")
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64}


class CheckpointError(ValueError):
    """Checkpoint or weight update does not match the model; nothing was written."""

    def __init__(self, where: str, missing=(), unexpected=(), mismatched=(), other=()):
        self.missing, self.unexpected = sorted(missing), sorted(unexpected)
        self.mismatched, self.other = list(mismatched), list(other)
        lines = [f"{where} does not match the model:"]
        for title, items in (("missing", self.missing), ("unexpected", self.unexpected),
                             ("mis-shaped", self.mismatched), ("other problems", self.other)):
            if items:
                shown = ", ".join(items[:20]) + (f", ... and {len(items) - 20} more" if len(items) > 20 else "")
                lines.append(f"  {title} ({len(items)}): {shown}")
        super().__init__("\n".join(lines))


@dataclass(frozen=True)
class WeightSpec:
    hf_name: str
    shape: tuple[int, ...]
    param: str  # model parameter name
    shard_dim: int | None  # None: replicated on every rank
    expert: int | None = None  # index into the fused expert tensor
    kind: str = "matrix"  # matrix | norm | bias | a_log | dt_bias (what dummy init draws)
    # (i, n): the parameter stacks n tensors along dim 0 and this is the i-th (gate and up of
    # the experts share one w13, each rank holding its shard of both)
    part: tuple[int, int] | None = None
    # (start, stop): rows of a replicated parameter that concatenates tensors of different
    # heights (MLA's q_a and kv_a projections read the same input: one GEMM)
    rows: tuple[int, int] | None = None

    def target(self, param: torch.Tensor) -> torch.Tensor:
        """This tensor's (this rank's) place in its model parameter."""
        t = param[self.expert] if self.expert is not None else param
        if self.rows is not None:
            return t[self.rows[0]:self.rows[1]]
        return t.unflatten(0, (self.part[1], -1))[self.part[0]] if self.part is not None else t

    def rank_index(self, tp: TPGroup) -> tuple[slice, ...]:
        if self.shard_dim is None:
            return (slice(None),)
        size = self.shape[self.shard_dim] // tp.world_size
        return (slice(None),) * self.shard_dim + (slice(tp.rank * size, (tp.rank + 1) * size),)


def weight_specs(cfg: ModelConfig) -> list[WeightSpec]:
    """Every tensor of the model in checkpoint order: DeepSeek-V3 names, or Kimi's (vLLM's
    Kimi-K3 loader: `block_sparse_moe`, experts `w1/w3/w2`, KDA projections and convs, attention
    residuals), with a `language_model.` prefix inside a kimi_k3 checkpoint."""
    h = cfg.hidden_size
    specs: list[WeightSpec] = []

    def add(name: str, shape: tuple[int, ...], shard_dim: int | None, kind: str = "matrix",
            param: str | None = None, rows: tuple[int, int] | None = None) -> None:
        specs.append(WeightSpec(name, shape, param or name, shard_dim, kind=kind, rows=rows))

    def mlp(prefix: str, inter: int, param: str | None = None) -> None:
        fused = f"{param or prefix}.gate_up_proj.weight"  # one GEMM for gate and up, as w13
        for i, proj in enumerate(("gate_proj", "up_proj")):
            specs.append(WeightSpec(f"{prefix}.{proj}.weight", (inter, h), fused, 0, part=(i, 2)))
        add(f"{prefix}.down_proj.weight", (h, inter), 1, param=f"{param or prefix}.down_proj.weight")

    add("model.embed_tokens.weight", (cfg.vocab_size, h), 0)
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        if cfg.is_kda_layer(i):
            _kda_specs(cfg, f"{p}.self_attn", add)
        else:
            _mla_specs(cfg, f"{p}.self_attn", add)
        add(f"{p}.input_layernorm.weight", (h,), None, "norm")
        add(f"{p}.post_attention_layernorm.weight", (h,), None, "norm")
        if cfg.attn_res_block_size is not None:
            for sub in ("self_attention", "mlp"):
                add(f"{p}.{sub}_res_norm.weight", (h,), None, "norm")
                add(f"{p}.{sub}_res_proj.weight", (1, h), None)
        if not cfg.is_moe_layer(i):
            mlp(f"{p}.mlp", cfg.intermediate_size)
            continue
        m, pm = (f"{p}.block_sparse_moe", f"{p}.mlp") if cfg.is_kimi else (f"{p}.mlp", f"{p}.mlp")
        width, inter = cfg.moe_latent_size or h, cfg.moe_intermediate_size
        add(f"{m}.gate.weight", (cfg.n_routed_experts, h), None, param=f"{pm}.gate.weight")
        add(f"{m}.gate.e_score_correction_bias", (cfg.n_routed_experts,), None, "bias",
            param=f"{pm}.gate.e_score_correction_bias")
        names = ("w1", "w3", "w2") if cfg.is_kimi else ("gate_proj", "up_proj", "down_proj")
        for j in range(cfg.n_routed_experts):
            e = f"{m}.experts.{j}"
            specs.append(WeightSpec(f"{e}.{names[0]}.weight", (inter, width), f"{pm}.experts.w13", 0, j, part=(0, 2)))
            specs.append(WeightSpec(f"{e}.{names[1]}.weight", (inter, width), f"{pm}.experts.w13", 0, j, part=(1, 2)))
            specs.append(WeightSpec(f"{e}.{names[2]}.weight", (width, inter), f"{pm}.experts.w2", 1, j))
        if cfg.n_shared_experts:
            mlp(f"{m}.shared_experts", inter * cfg.n_shared_experts, param=f"{pm}.shared_experts")
        if cfg.is_latent:
            add(f"{m}.routed_expert_down_proj.weight", (width, h), None, param=f"{pm}.routed_expert_down_proj.weight")
            if cfg.latent_moe_use_norm:
                add(f"{m}.routed_expert_norm.weight", (width,), None, "norm", param=f"{pm}.routed_expert_norm.weight")
            add(f"{m}.routed_expert_up_proj.weight", (h, width), None, param=f"{pm}.routed_expert_up_proj.weight")
    if cfg.attn_res_block_size is not None:
        add("model.output_attn_res_norm.weight", (h,), None, "norm")
        add("model.output_attn_res_proj.weight", (1, h), None)
    add("model.norm.weight", (h,), None, "norm")
    if not cfg.tie_word_embeddings:
        add("lm_head.weight", (cfg.vocab_size, h), 0)
    if cfg.multimodal_wrapper is not None:
        specs = [dataclasses.replace(s, hf_name=WRAPPER_PREFIX + s.hf_name) for s in specs]
    return specs


def _mla_specs(cfg: ModelConfig, a: str, add) -> None:
    h, n, q_lora = cfg.hidden_size, cfg.num_attention_heads, cfg.q_lora_rank
    # With a q LoRA, q_a and kv_a both project the layer input: one parameter, one GEMM.
    fused = f"{a}.fused_qkv_a_proj.weight" if q_lora else None
    if q_lora:
        add(f"{a}.q_a_proj.weight", (q_lora, h), None, param=fused, rows=(0, q_lora))
        add(f"{a}.q_a_layernorm.weight", (q_lora,), None, "norm")
        add(f"{a}.q_b_proj.weight", (n * cfg.qk_head_dim, q_lora), 0)
    else:
        add(f"{a}.q_proj.weight", (n * cfg.qk_head_dim, h), 0)
    add(f"{a}.kv_a_proj_with_mqa.weight", (cfg.kv_cache_dim, h), None, param=fused,
        rows=(q_lora, q_lora + cfg.kv_cache_dim) if q_lora else None)
    add(f"{a}.kv_a_layernorm.weight", (cfg.kv_lora_rank,), None, "norm")
    add(f"{a}.kv_b_proj.weight", (n * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), 0)
    add(f"{a}.o_proj.weight", (h, n * cfg.v_head_dim), 1)
    if cfg.mla_use_output_gate:
        add(f"{a}.g_proj.weight", (n * cfg.v_head_dim, h), 0)


def _kda_specs(cfg: ModelConfig, a: str, add) -> None:
    """Heads split across ranks; the low-rank input of the forget gate (and of Kimi-Linear's
    output gate) and the per-head-dim output norm are replicated."""
    h, heads, d = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim
    proj = heads * d
    for x in ("q", "k", "v"):
        add(f"{a}.{x}_proj.weight", (proj, h), 0)
    for x in ("q", "k", "v"):
        add(f"{a}.{x}_conv1d.weight", (proj, 1, cfg.kda_conv_size), 0)
    add(f"{a}.f_a_proj.weight", (d, h), None)
    add(f"{a}.f_b_proj.weight", (proj, d), 0)
    add(f"{a}.dt_bias", (proj,), 0, "dt_bias")
    add(f"{a}.A_log", (heads,), 0, "a_log")
    add(f"{a}.b_proj.weight", (heads, h), 0)
    if cfg.kda_full_rank_gate:
        add(f"{a}.g_proj.weight", (proj, h), 0)
    else:
        add(f"{a}.g_a_proj.weight", (d, h), None)
        add(f"{a}.g_b_proj.weight", (proj, d), 0)
    add(f"{a}.o_norm.weight", (d,), None, "norm")
    add(f"{a}.o_proj.weight", (h, proj), 1)


def fp8_pairs(cfg: ModelConfig) -> list[tuple[WeightSpec, WeightSpec]]:
    """(weight, its `_scale_inv`) of every FP8 weight of an FP8 model; [] for a plain one."""
    block = fp8_block(cfg)
    if block is None:
        return []
    return [(s, scale_spec(s, block)) for s in weight_specs(cfg) if is_fp8_weight(s)]


def check_fp8_layout(cfg: ModelConfig, world_size: int) -> None:
    """ConfigError unless every FP8 parameter's blocks survive TP sharding and stacking."""
    block = fp8_block(cfg)
    if block is None:
        return
    problems = []
    for s, _ in fp8_pairs(cfg):
        if held_fp8(s.param):
            rows = s.shape[0] // (world_size if s.shard_dim == 0 else 1) * (s.part[1] if s.part else 1)
            problems += layout_problems(s, block, world_size, rows)
    problems = list(dict.fromkeys(re.sub(r"experts\.\d+\.", "experts.*.", p) for p in problems))
    if problems:
        raise ConfigError(f"FP8 weights with weight_block_size {list(block)} cannot be sharded at TP {world_size}: "
                          + "; ".join(problems[:8]) + (f"; ... and {len(problems) - 8} more" if len(problems) > 8 else ""))


def expected_weights(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    return {s.hf_name: s.shape for s in weight_specs(cfg)}


def canonical_name(cfg: ModelConfig, name: str) -> str:
    """The weight table's spelling of a checkpoint name (both K3 wrapper spellings are in use)."""
    if cfg.multimodal_wrapper is not None and name.startswith(WRAPPER_PREFIX + "layers."):
        return WRAPPER_PREFIX + "model." + name[len(WRAPPER_PREFIX):]
    return name


def _ignorable(cfg: ModelConfig, name: str) -> bool:
    """Names a checkpoint may carry that this model does not use."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    if cfg.multimodal_wrapper is not None:
        if name.startswith(_VISION_PREFIXES):
            return True
        name = name.removeprefix(WRAPPER_PREFIX)
    if cfg.tie_word_embeddings and name == "lm_head.weight":
        return True
    parts = name.split(".")
    # DeepSeek-V3 checkpoints append multi-token-prediction layers after the last layer.
    return (len(parts) > 2 and parts[:2] == ["model", "layers"] and parts[2].isdigit()
            and int(parts[2]) >= cfg.num_hidden_layers)


def _same_shape(shape: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    """Equal up to unit dims: checkpoints store KDA's A_log as [H] or [1, 1, H, 1] (transformers)
    and its conv weights as [C, 1, K] or [C, K]; vLLM accepts both."""
    return tuple(shape) == tuple(expected) or [d for d in shape if d != 1] == [d for d in expected if d != 1]


# ---- checks ------------------------------------------------------------------------------------

def _dtype_ok(dtype) -> bool:
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype.upper(), getattr(torch, dtype, None) if dtype.islower() else None)
    return dtype in _DTYPES.values()


def _problems(cfg: ModelConfig, shapes: Mapping[str, tuple], where: str, complete: bool) -> CheckpointError | None:
    """`shapes`: {name: (shape, dtype)}. None when everything fits."""
    expected = expected_weights(cfg)
    pairs = fp8_pairs(cfg)
    scales = {sc.hf_name: (w.hf_name, sc.shape) for w, sc in pairs}
    fp8_names = {w.hf_name for w, _ in pairs}
    given = {canonical_name(cfg, n): v for n, v in shapes.items()}
    unexpected, mismatched, other = [], [], []
    for name, (shape, dtype) in shapes.items():
        name = canonical_name(cfg, name)
        if name in scales:  # an FP8 weight's block scales: only next to an FP8 weight
            base, want = scales[name]
            if tuple(shape) != want:
                mismatched.append(f"{name}: {list(shape)} vs expected {list(want)}")
            if not is_scale_dtype(dtype):
                other.append(f"{name}: unsupported scale dtype {dtype}")
            if base not in given or not is_fp8_dtype(given[base][1]):
                other.append(f"{name}: a scale without its FP8 weight {base}")
            continue
        if name in fp8_names and is_fp8_dtype(dtype):
            if name + SCALE_SUFFIX not in given:
                other.append(f"{name}: an FP8 weight without its {name + SCALE_SUFFIX}")
            if not _same_shape(shape, expected[name]):
                mismatched.append(f"{name}: {list(shape)} vs expected {list(expected[name])}")
            continue
        if name not in expected:
            if not _ignorable(cfg, name):
                unexpected.append(name)
            continue
        if not _same_shape(shape, expected[name]):
            mismatched.append(f"{name}: {list(shape)} vs expected {list(expected[name])}")
        if not _dtype_ok(dtype):
            other.append(f"{name}: unsupported dtype {dtype}")
    missing = [n for n in expected if n not in given] if complete else []
    if missing or unexpected or mismatched or other:
        return CheckpointError(where, missing, unexpected, mismatched, other)
    return None


def check_weights(cfg: ModelConfig, shapes: Mapping[str, tuple]) -> list[str]:
    """Problems with a (possibly partial) weight update {name: (shape, dtype)}: unknown names,
    wrong shapes, unsupported dtypes. Empty when it can be applied."""
    err = _problems(cfg, shapes, "weight update", complete=False)
    if err is None:
        return []
    return ([f"unknown weight {n}" for n in err.unexpected] + [f"wrong shape {m}" for m in err.mismatched]
            + err.other)
