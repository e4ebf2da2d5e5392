"""Weights in Hugging Face DeepSeek-V3 names: dummy init, checkpoints, trainer updates.

One table (`weight_specs`) says, for every logical HF-named tensor, its full shape, which
model parameter holds it (an expert index into the fused tensors for routed experts) and
along which dim TP shards it. Dummy init, checkpoint loading, trainer updates and export all
go through that table and the same slicing code, so TP 1/2/4 hold the same logical model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import zlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from .config import ModelConfig
from .parallel import TPGroup

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_SHARD_BYTES = 2 << 30
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

    def target(self, param: torch.Tensor) -> torch.Tensor:
        """This tensor's (this rank's) place in its model parameter."""
        t = param[self.expert] if self.expert is not None else param
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
            param: str | None = None) -> None:
        specs.append(WeightSpec(name, shape, param or name, shard_dim, kind=kind))

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
    h, n = cfg.hidden_size, cfg.num_attention_heads
    if cfg.q_lora_rank:
        add(f"{a}.q_a_proj.weight", (cfg.q_lora_rank, h), None)
        add(f"{a}.q_a_layernorm.weight", (cfg.q_lora_rank,), None, "norm")
        add(f"{a}.q_b_proj.weight", (n * cfg.qk_head_dim, cfg.q_lora_rank), 0)
    else:
        add(f"{a}.q_proj.weight", (n * cfg.qk_head_dim, h), 0)
    add(f"{a}.kv_a_proj_with_mqa.weight", (cfg.kv_cache_dim, h), None)
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


# ---- writing into the model ------------------------------------------------------------------

def _targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


@torch.no_grad()
def _assign(params: dict[str, torch.Tensor], spec: WeightSpec, source, tp: TPGroup) -> None:
    """Copy this rank's slice of `source` (a full tensor or a safetensors slice) into the model."""
    target = spec.target(params[spec.param].data)
    if tuple(_shape(source)) != spec.shape:  # e.g. A_log stored [1, 1, H, 1] (see _same_shape)
        source = source[:].reshape(spec.shape)
    piece = source[spec.rank_index(tp)]
    if tuple(piece.shape) != tuple(target.shape):
        raise CheckpointError(spec.hf_name, mismatched=[f"{spec.hf_name}: slice {list(piece.shape)} "
                                                        f"vs parameter {list(target.shape)}"])
    target.copy_(piece)


def _shape(source) -> tuple[int, ...]:
    return tuple(source.get_shape()) if hasattr(source, "get_shape") else tuple(source.shape)


def _same_shape(shape: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    """Equal up to unit dims: checkpoints store KDA's A_log as [H] or [1, 1, H, 1] (transformers)
    and its conv weights as [C, 1, K] or [C, K]; vLLM accepts both."""
    return tuple(shape) == tuple(expected) or [d for d in shape if d != 1] == [d for d in expected if d != 1]


def _dummy_tensor(spec: WeightSpec, cfg: ModelConfig, seed: int) -> torch.Tensor:
    # torch's CPU generator keeps only 32 bits of a seed: mix the seed into the name's crc32
    # (a bijection per seed, so every tensor of a model still gets its own stream).
    g = torch.Generator().manual_seed((zlib.crc32(spec.hf_name.encode()) ^ (seed * 0x9E3779B1)) & 0xFFFFFFFF)
    if spec.kind == "norm":
        return torch.ones(spec.shape)
    if spec.kind == "bias":
        # Small but non-zero, so the biased choice and the unbiased weights really differ.
        return torch.randn(spec.shape, generator=g) * 0.01
    if spec.kind == "a_log":  # KDA decay rates exp(A_log) in [1, 16], as FLA initialises them
        return (1 + 15 * torch.rand(spec.shape, generator=g)).log()
    if spec.kind == "dt_bias":  # inverse softplus of a time step in [1e-3, 1e-1]
        dt = (math.log(1e-3) + (math.log(1e-1) - math.log(1e-3)) * torch.rand(spec.shape, generator=g)).exp()
        return dt + torch.log(-torch.expm1(-dt))
    return torch.randn(spec.shape, generator=g) * cfg.initializer_range


def checkpoint_tensors(cfg: ModelConfig, seed: int = 0) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, full fp32 tensor) of the dummy model; each drawn from its own seeded generator."""
    for spec in weight_specs(cfg):
        yield spec.hf_name, _dummy_tensor(spec, cfg, seed)


def init_dummy_weights(model: torch.nn.Module, cfg: ModelConfig, tp: TPGroup, seed: int = 0) -> None:
    params = _targets(model)
    for spec in weight_specs(cfg):
        _assign(params, spec, _dummy_tensor(spec, cfg, seed), tp)


# ---- checks ------------------------------------------------------------------------------------

def _dtype_ok(dtype) -> bool:
    if isinstance(dtype, str):
        dtype = _DTYPES.get(dtype.upper(), getattr(torch, dtype, None) if dtype.islower() else None)
    return dtype in _DTYPES.values()


def _problems(cfg: ModelConfig, shapes: Mapping[str, tuple], where: str, complete: bool) -> CheckpointError | None:
    """`shapes`: {name: (shape, dtype)}. None when everything fits."""
    expected = expected_weights(cfg)
    unexpected, mismatched, other = [], [], []
    for name, (shape, dtype) in shapes.items():
        name = canonical_name(cfg, name)
        if name not in expected:
            if not _ignorable(cfg, name):
                unexpected.append(name)
            continue
        if not _same_shape(shape, expected[name]):
            mismatched.append(f"{name}: {list(shape)} vs expected {list(expected[name])}")
        if not _dtype_ok(dtype):
            other.append(f"{name}: unsupported dtype {dtype}")
    given = {canonical_name(cfg, n) for n in shapes}
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


def load_weights(model: torch.nn.Module, cfg: ModelConfig, tp: TPGroup,
                 named_tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
    """Full HF-named tensors (e.g. from a trainer), any subset; all are checked before any is
    written. Names the model ignores (MTP layers, tied lm_head) are skipped. Returns the count loaded."""
    items = list(named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors)
    err = _problems(cfg, {n: (tuple(t.shape), t.dtype) for n, t in items}, "weight update", complete=False)
    if err is not None:
        raise err
    specs = {s.hf_name: s for s in weight_specs(cfg)}
    params = _targets(model)
    loaded = 0
    for name, tensor in items:
        spec = specs.get(canonical_name(cfg, name))
        if spec is not None:
            _assign(params, spec, tensor, tp)
            loaded += 1
    return loaded


# ---- checkpoints -------------------------------------------------------------------------------

def _checkpoint_files(directory: str) -> dict[str, str]:
    """{tensor name: file path} from the index, or from a single model.safetensors."""
    index = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index):
        with open(index) as f:
            return {n: os.path.join(directory, fn) for n, fn in json.load(f)["weight_map"].items()}
    single = os.path.join(directory, SINGLE_FILE)
    if not os.path.exists(single):
        raise CheckpointError(f"checkpoint {directory!r}", other=[f"no {INDEX_FILE} or {SINGLE_FILE}"])
    with safe_open(single, "pt") as f:
        return {n: single for n in f.keys()}


def load_checkpoint(model: torch.nn.Module, cfg: ModelConfig, tp: TPGroup, directory: str,
                    progress: bool = True) -> int:
    """Each rank reads only its slices. Everything is checked (names, shapes, dtypes) before
    the first tensor is written, so a bad checkpoint leaves the model untouched."""
    files = _checkpoint_files(directory)
    shapes = {}
    for path in sorted(set(files.values())):
        with safe_open(path, "pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                shapes[name] = (tuple(sl.get_shape()), sl.get_dtype())
    listed_absent = [n for n in files if n not in shapes]
    err = _problems(cfg, shapes, f"checkpoint {directory!r}", complete=True)
    if err is not None or listed_absent:
        err = err or CheckpointError(f"checkpoint {directory!r}")
        if listed_absent:
            err = CheckpointError(f"checkpoint {directory!r}", err.missing, err.unexpected, err.mismatched,
                                  err.other + [f"index lists {n} but no file holds it" for n in listed_absent])
        raise err
    specs = {s.hf_name: s for s in weight_specs(cfg)}
    params = _targets(model)
    by_file: dict[str, list[str]] = {}
    for name, path in files.items():
        if canonical_name(cfg, name) in specs:
            by_file.setdefault(path, []).append(name)
    bar = tqdm(total=len(specs), desc="loading weights", unit="tensor", file=sys.stderr, disable=not progress)
    for path, names in sorted(by_file.items()):
        with safe_open(path, "pt") as f:
            for name in names:
                _assign(params, specs[canonical_name(cfg, name)], f.get_slice(name), tp)
                bar.update()
    bar.close()
    return len(specs)


def save_checkpoint(cfg: ModelConfig, directory: str, named_tensors: Iterable[tuple[str, torch.Tensor]]
                    | Mapping[str, torch.Tensor], max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[str]:
    """config.json, model-0000k-of-0000n.safetensors shards and the index, in HF names.
    Streams: at most one shard is held in memory. Returns the shard file names."""
    os.makedirs(directory, exist_ok=True)
    items = named_tensors.items() if isinstance(named_tensors, Mapping) else named_tensors
    tmp_names: list[str] = []
    weight_map: dict[str, int] = {}
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        nonlocal shard, size
        if shard:
            tmp = os.path.join(directory, f".shard-{len(tmp_names)}.tmp")
            save_file(shard, tmp, metadata={"format": "pt"})
            tmp_names.append(tmp)
            shard, size = {}, 0

    for name, t in items:
        nbytes = t.numel() * t.element_size()
        if shard and size + nbytes > max_shard_bytes:
            flush()
        shard[name] = t.detach().to("cpu").contiguous()
        weight_map[name] = len(tmp_names)
        size += nbytes
        total += nbytes
    flush()
    n = len(tmp_names)
    final = [f"model-{k + 1:05d}-of-{n:05d}.safetensors" for k in range(n)]
    for tmp, fn in zip(tmp_names, final):
        os.replace(tmp, os.path.join(directory, fn))
    index = {"metadata": {"total_size": total}, "weight_map": {k: final[v] for k, v in sorted(weight_map.items())}}
    with open(os.path.join(directory, INDEX_FILE), "w") as f:
        json.dump(index, f, indent=2)
    cfg.save(directory)
    return final


def _cast(name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.float() if name.endswith(FP32_SUFFIXES) else t.to(dtype)


def write_dummy_checkpoint(cfg: ModelConfig, directory: str, seed: int = 0, dtype: torch.dtype = torch.bfloat16,
                           max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> list[str]:
    cfg = dataclasses.replace(cfg, torch_dtype=str(dtype).removeprefix("torch."))
    tensors = ((n, _cast(n, t, dtype)) for n, t in checkpoint_tensors(cfg, seed))
    return save_checkpoint(cfg, directory, tensors, max_shard_bytes=max_shard_bytes)


@torch.no_grad()
def export_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF-named full tensors of a TP-1 model (e.g. to save it for transformers)."""
    if model.tp.world_size != 1:
        raise ValueError("export_state needs a TP-1 model: shards of a TP-N model are not full tensors")
    params = _targets(model)
    out = {}
    for spec in weight_specs(model.config):
        out[spec.hf_name] = spec.target(params[spec.param]).detach().clone()
    return out


def materialize_plain(model: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """Pool-less materialisation of a meta-built model: fresh storage, buffers recomputed.
    Parameters hold garbage until weights are loaded or dummy-initialised."""
    model.to_empty(device=device)
    model.reset_buffers()
    return model
