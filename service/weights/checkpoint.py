"""Checkpoints and weights in and out of the model, through the weight table (specs.py): dummy
init (TP-invariant), safetensors load (sharded per rank) and save in HF names, trainer updates,
export of the full tensors.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import zlib
from collections.abc import Iterable, Iterator, Mapping

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from ..config import ModelConfig
from ..parallel import TPGroup
from .fp8 import (
    FP8,
    SCALE_SUFFIX,
    dequantize,
    fake_quantize,
    fp8_block,
    is_fp8_dtype,
    is_fp8_weight,
    quantize,
    scale_spec,
)
from .specs import (
    FP32_SUFFIXES,
    CheckpointError,
    WeightSpec,
    _problems,
    canonical_name,
    fp8_pairs,
    weight_specs,
)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DEFAULT_SHARD_BYTES = 2 << 30


# ---- writing into the model ------------------------------------------------------------------

def _targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters())


@torch.no_grad()
def _assign(params: dict[str, torch.Tensor], spec: WeightSpec, source, tp: TPGroup,
            block: tuple[int, int] | None = None, scale=None) -> None:
    """Copy this rank's slice of `source` (a full tensor or a safetensors slice) into the model.
    In an FP8 model (`block`) an FP8 weight comes with its `scale` (checkpoint or trainer) or is
    quantized here from a float tensor (a bf16 checkpoint under `--quantization fp8`, a trainer's
    bf16 update), over the full tensor's blocks, so every TP size holds the same values."""
    if block is not None and is_fp8_weight(spec):
        _assign_fp8(params, spec, source, tp, block, scale)
        return
    target = spec.target(params[spec.param].data)
    if tuple(_shape(source)) != spec.shape:  # e.g. A_log stored [1, 1, H, 1] (see _same_shape)
        source = source[:].reshape(spec.shape)
    piece = source[spec.rank_index(tp)]
    if tuple(piece.shape) != tuple(target.shape):
        raise CheckpointError(spec.hf_name, mismatched=[f"{spec.hf_name}: slice {list(piece.shape)} "
                                                        f"vs parameter {list(target.shape)}"])
    target.copy_(piece)


def _assign_fp8(params, spec: WeightSpec, source, tp: TPGroup, block: tuple[int, int], scale) -> None:
    sspec = scale_spec(spec, block)
    held = params[spec.param].dtype == FP8
    if scale is not None and not is_fp8_dtype(_dtype(source)):
        raise CheckpointError(spec.hf_name, other=[f"{sspec.hf_name} given for a weight that is not FP8"])
    if held and scale is not None:  # FP8 in, FP8 held: each rank reads only its blocks
        _assign(params, spec, source, tp)
        _assign(params, sspec, scale, tp)
        return
    full = source[:].reshape(spec.shape)
    if held:
        q, s = quantize(full, block)
        _assign(params, spec, q, tp)
        _assign(params, sspec, s, tp)
        return
    dtype = params[spec.param].dtype  # held dequantized (HELD_DEQUANTIZED)
    w = dequantize(full, scale[:], block, dtype) if scale is not None else fake_quantize(full.to(dtype), block)
    _assign(params, spec, w, tp)


def _dtype(source):
    return source.get_dtype() if hasattr(source, "get_dtype") else source.dtype


def _shape(source) -> tuple[int, ...]:
    return tuple(source.get_shape()) if hasattr(source, "get_shape") else tuple(source.shape)


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
    block = fp8_block(cfg)
    for spec in weight_specs(cfg):
        _assign(params, spec, _dummy_tensor(spec, cfg, seed), tp, block)


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
    block = fp8_block(cfg)
    scales = {canonical_name(cfg, n): t for n, t in items if n.endswith(SCALE_SUFFIX)} if block else {}
    loaded = 0
    for name, tensor in items:
        spec = specs.get(canonical_name(cfg, name))
        if spec is not None:
            _assign(params, spec, tensor, tp, block, scales.get(spec.hf_name + SCALE_SUFFIX))
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
    block = fp8_block(cfg)
    scale_files = {canonical_name(cfg, n): (n, p) for n, p in files.items() if n.endswith(SCALE_SUFFIX)}
    bar = tqdm(total=len(specs), desc="loading weights", unit="tensor", file=sys.stderr, disable=not progress)
    for path, names in sorted(by_file.items()):
        with safe_open(path, "pt") as f:
            for name in names:
                spec = specs[canonical_name(cfg, name)]
                scale = _read_scale(scale_files.get(spec.hf_name + SCALE_SUFFIX)) if block else None
                _assign(params, spec, f.get_slice(name), tp, block, scale)
                bar.update()
    bar.close()
    return len(specs)


def _read_scale(where: tuple[str, str] | None) -> torch.Tensor | None:
    """An FP8 weight's block scales (small: 1/16384 of its elements), whole."""
    if where is None:
        return None
    with safe_open(where[1], "pt") as f:
        return f.get_tensor(where[0])


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
    block = fp8_block(model.config)
    for spec, sspec in fp8_pairs(model.config):  # FP8 models export the FP8 checkpoint format
        if sspec.param in params:
            out[sspec.hf_name] = sspec.target(params[sspec.param]).detach().clone()
        else:  # held dequantized: quantizing its (already FP8-exact) values again is lossless
            out[spec.hf_name], out[sspec.hf_name] = quantize(out[spec.hf_name], block)
    return out


def materialize_plain(model: torch.nn.Module, device: torch.device | str) -> torch.nn.Module:
    """Pool-less materialisation of a meta-built model: fresh storage, buffers recomputed.
    Parameters hold garbage until weights are loaded or dummy-initialised."""
    model.to_empty(device=device)
    model.reset_buffers()
    return model
