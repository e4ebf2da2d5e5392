"""FP8 block-scaled weights in DeepSeek-V3's checkpoint format: which tensors are FP8, their
`<name>_scale_inv` companions, and the quantize/dequantize arithmetic (torch, any device).

A checkpoint is FP8 when its config.json has `quantization_config = {"quant_method": "fp8",
"fmt": "e4m3", "weight_block_size": [bn, bk], "activation_scheme": "dynamic"}`: every linear
projection weight W [N, K] is `float8_e4m3fn` with an fp32 `W_scale_inv` [ceil(N/bn),
ceil(K/bk)], and W = fp8 * scale_inv per bn x bk block. Embeddings, lm_head, the router, norms,
biases and KDA's small low-rank/gate tensors stay in the model dtype.

No imports from the rest of service.weights: the weight table (specs.py) and the model's
parameter conversion (model/fp8.py) both build on this module.
"""

from __future__ import annotations

import dataclasses

import torch

from ..config import ConfigError, ModelConfig

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
SCALE_SUFFIX = "_scale_inv"
# What `--quantization fp8` writes into a bf16 model's config (DeepSeek-V3's own values).
DEFAULT_QUANTIZATION = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                        "activation_scheme": "dynamic"}
# FP8 in the checkpoint, but held dequantized in the model dtype: MLA's absorbed decode slices
# kv_b into W_UK / W_UV and runs batched matmuls on them, and the fused MoE tail reads the latent
# up-projection as a plain matrix. Both are a small share of a layer's bytes (kv_b is 16.8M of
# DeepSeek-V3's ~190M parameters per MoE layer at TP 1, 1/8 of that per rank at TP 8).
HELD_DEQUANTIZED = (".kv_b_proj.weight", ".routed_expert_up_proj.weight")
# Kimi's tensors that stay in the model dtype: KDA's low-rank gate inputs and per-head beta, and
# the attention residuals' [1, H] queries (read as vectors by attn_res).
_SMALL = (".f_a_proj.weight", ".f_b_proj.weight", ".b_proj.weight", ".g_a_proj.weight", ".g_b_proj.weight",
          "_res_proj.weight")
_SAFETENSORS_FP8 = ("F8_E4M3",)


def fp8_block(cfg: ModelConfig) -> tuple[int, int] | None:
    """(bn, bk) of an FP8 block-scaled model, None for a plain one; ConfigError for an FP8
    config we cannot serve (per-tensor scales, static activation scales, e5m2)."""
    q = cfg.extra.get("quantization_config")
    if not q:
        return None
    if q.get("quant_method") != "fp8":
        raise ConfigError(f"quantization_config.quant_method={q.get('quant_method')!r}: only 'fp8' is supported")
    if q.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"quantization_config.fmt={q.get('fmt')!r}: only 'e4m3' is supported")
    if q.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigError("quantization_config.activation_scheme must be 'dynamic' (no input_scale tensors)")
    block = q.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(isinstance(b, int) and b > 0 and b & (b - 1) == 0 for b in block)):
        raise ConfigError(f"quantization_config.weight_block_size={block!r}: two powers of two, e.g. [128, 128] "
                          "(per-tensor FP8 is not supported)")
    return int(block[0]), int(block[1])


def with_quantization(cfg: ModelConfig, method: str | None) -> ModelConfig:
    """The engine's `quantization` option: 'fp8' makes a bf16 model FP8 (its weights are
    quantized as they load); an FP8 checkpoint needs no option."""
    if method is None:
        return cfg
    if method != "fp8":
        raise ConfigError(f"quantization={method!r}: only 'fp8' is supported")
    if cfg.extra.get("quantization_config"):
        fp8_block(cfg)
        return cfg
    return dataclasses.replace(cfg, extra={**cfg.extra, "quantization_config": dict(DEFAULT_QUANTIZATION)})


def is_fp8_weight(spec) -> bool:
    """A weight-table entry FP8 checkpoints store in FP8 (every linear projection but KDA's small ones)."""
    name = spec.hf_name
    return (spec.kind == "matrix" and len(spec.shape) == 2 and not name.endswith(_SMALL)
            and name.endswith(("_proj.weight", "_proj_with_mqa.weight", ".w1.weight", ".w2.weight", ".w3.weight")))


def held_fp8(param: str) -> bool:
    return not param.endswith(HELD_DEQUANTIZED)


def is_fp8_dtype(dtype) -> bool:
    return dtype == FP8 or (isinstance(dtype, str) and dtype.upper() in _SAFETENSORS_FP8)


def is_scale_dtype(dtype) -> bool:
    return dtype in (torch.float32, torch.bfloat16) or (isinstance(dtype, str) and dtype.upper() in ("F32", "BF16"))


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """Scale grid of a weight [..., N, K]: [..., ceil(N/bn), ceil(K/bk)]."""
    return tuple(shape[:-2]) + (-(-shape[-2] // block[0]), -(-shape[-1] // block[1]))


def scale_spec(spec, block: tuple[int, int]):
    """The `_scale_inv` entry of an FP8 weight: same parameter placement, in blocks."""
    bn = block[0]
    rows = (spec.rows[0] // bn, -(-spec.rows[1] // bn)) if spec.rows is not None else None
    return dataclasses.replace(spec, hf_name=spec.hf_name + SCALE_SUFFIX, shape=scale_shape(spec.shape, block),
                               param=spec.param + SCALE_SUFFIX, kind="scale", rows=rows)


def layout_problems(spec, block: tuple[int, int], world_size: int, param_rows: int) -> list[str]:
    """Why this FP8 weight's blocks cannot be held as-is on `world_size` ranks ([] when they can):
    TP shards and the tensors stacked in one parameter must start on block boundaries."""
    bn, bk = block
    out = []
    if spec.shard_dim is not None and world_size > 1:
        size = spec.shape[spec.shard_dim] // world_size
        b = bn if spec.shard_dim == 0 else bk
        if size % b:
            out.append(f"{spec.hf_name}: a TP {world_size} shard of dim {spec.shard_dim} is {size}, "
                       f"not a multiple of the {b} of weight_block_size")
    if spec.rows is not None and spec.rows[0] % bn:
        out.append(f"{spec.hf_name}: starts at row {spec.rows[0]} of {spec.param}, not on a {bn}-row block")
    if spec.part is not None and spec.part[1] > 1 and (param_rows // spec.part[1]) % bn:
        out.append(f"{spec.hf_name}: {param_rows // spec.part[1]} rows per rank, stacked in {spec.param}, "
                   f"is not a multiple of {bn}")
    return out


# ---- arithmetic ----------------------------------------------------------------------------

def _blocked(t: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[..., N, K] zero-padded to whole blocks, viewed [..., N/bn, bn, K/bk, bk]."""
    n, k = t.shape[-2:]
    bn, bk = block
    pn, pk = -(-n // bn) * bn, -(-k // bk) * bk
    if (pn, pk) != (n, k):
        t = torch.nn.functional.pad(t, (0, pk - k, 0, pn - n))
    return t.unflatten(-1, (pk // bk, bk)).unflatten(-3, (pn // bn, bn))


@torch.no_grad()
def quantize(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., N, K] float -> (fp8 [..., N, K], fp32 scale_inv [..., ceil(N/bn), ceil(K/bk)]),
    scale = amax/448 per block as DeepSeek's conversion script (an all-zero block gets scale 1)."""
    n, k = w.shape[-2:]
    b = _blocked(w.float(), block)
    amax = b.abs().amax(dim=(-3, -1))  # [..., N/bn, K/bk]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (b / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    q = q.flatten(-2).flatten(-3, -2)[..., :n, :k]
    return q.contiguous(), scale.contiguous()


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp8 [..., N, K] * scale_inv per block -> dtype. `block` defaults to the one the shapes imply."""
    n, k = q.shape[-2:]
    bn, bk = block or implied_block(q.shape, scale.shape)
    s = scale.float().repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)[..., :n, :k]
    return (q.float() * s).to(dtype)


def fake_quantize(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """w as an FP8 model would see it (quantized, then dequantized to w's dtype)."""
    return dequantize(*quantize(w, block), block, w.dtype)


def implied_block(shape: tuple[int, ...], scale_shape_: tuple[int, ...]) -> tuple[int, int]:
    """The power-of-two block that maps a weight's last two dims onto its scale grid: exact
    when the grid has two or more blocks along a dim, and with a single block any size >= the
    dim gives the same dequantization."""
    def one(dim: int, blocks: int) -> int:
        per = -(-dim // blocks)
        return 1 << max(per - 1, 0).bit_length()
    return one(shape[-2], scale_shape_[-2]), one(shape[-1], scale_shape_[-1])


def block_of(weight: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """implied_block of a weight and its `_scale_inv` tensor."""
    return implied_block(tuple(weight.shape), tuple(scale.shape))


def kernel_operands(x: torch.Tensor, weight: torch.Tensor, interpreted: bool) -> bool:
    """What every FP8 Triton kernel takes: an FP8 weight with contiguous K against 16-bit
    activations. Interpreted (CPU tests), fp16 only: the interpreter's tl.dot takes no bf16."""
    ok_x = x.dtype == torch.float16 if interpreted else x.dtype in (torch.bfloat16, torch.float16)
    return ok_x and weight.dtype == FP8 and weight.stride(-1) == 1
