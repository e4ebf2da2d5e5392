"""Building blocks with tensor parallelism: norms, TP linears, vocab-parallel embedding and
lm_head, the gated MLP (SwiGLU or Kimi's SiTU), and DeepSeek's rotary embedding.

Every parameter is created with `torch.empty` so the model can be built on the `meta` device;
weights arrive later (dummy init, checkpoint or trainer). Parameters never need grads here.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError, ModelConfig
from ..parallel import TPGroup
from . import dense_mm, fp8, gemv, gemv_gated
from .fusion import fused


def frozen(*shape: int, dtype: torch.dtype) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)


class KeepFloat32:
    """Mixin: the named tensors stay float32 through `module.to(dtype)`.

    The router bias and the rope table need fp32 resolution whatever the model dtype (a bf16
    bias flips expert choices; bf16 angles drift with position), as in transformers and vLLM.
    """

    fp32_tensors: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for name in self.fp32_tensors:
            t = getattr(self, name)
            if t.dtype == torch.float32:
                continue
            if isinstance(t, nn.Parameter):
                t.data = t.data.float()
            else:
                self._buffers[name] = t.float()
                self._after_fp32_restore()
        return self

    def _after_fp32_restore(self) -> None:
        pass


class RMSNorm(nn.Module):
    """transformers' DeepseekV3RMSNorm: normalise in fp32, cast back, then scale."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.weight = frozen(dim, dtype=dtype)
        self.eps = eps

    def forward(self, x: torch.Tensor, add: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x + add): the residual add rounded as its own op would round it, in one chain."""
        if x.device.type == "cpu":  # torch's rms_norm: 5 ops instead of 8, bit-identical here
            x = x if add is None else x + add
            return self.weight * F.rms_norm(x.float(), (x.shape[-1],), None, self.eps).to(x.dtype)
        if add is not None:
            return add_rms_norm_hf(x, add, self.weight, self.eps)
        return rms_norm_hf(x, self.weight, self.eps)


def _rms_norm_hf(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


rms_norm_hf = fused(_rms_norm_hf)


@fused
def add_rms_norm_hf(x: torch.Tensor, add: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _rms_norm_hf(x + add, weight, eps)


def linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T for every dense projection of the model: the one place that picks a kernel
    for a weight's format and the number of rows. `scale`: an FP8 weight's block scales."""
    if scale is not None:  # FP8 block-scaled (model/fp8.py)
        return fp8.linear_fp8(x, weight, scale)
    if gemv.supported(x, weight):  # decode-sized M on a GPU: bandwidth-shaped, not cuBLAS tiles
        out = gemv.run(torch.ops.latentserve.gemv, x, weight)
        if out is not None:
            return out
    if dense_mm.enabled(x):  # cuBLAS where Inductor cannot fold a residual add into addmm's copy
        return torch.ops.latentserve.mm_t(x, weight)
    return F.linear(x, weight)


def _no_scale(module: nn.Module) -> None:
    """An FP8 model registers the weight's block scales here (model/fp8.quantize_parameters)."""
    module.register_parameter("weight_scale_inv", None)


class ReplicatedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.weight = frozen(out_features, in_features, dtype=dtype)
        _no_scale(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.weight_scale_inv)


class ColumnParallelLinear(nn.Module):
    """Output dim split across ranks; each rank returns its slice of the output."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.weight = frozen(out_features // tp.world_size, in_features, dtype=dtype)
        _no_scale(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.weight_scale_inv)


class RowParallelLinear(nn.Module):
    """Input dim split across ranks; the output is a partial sum unless reduced here."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.weight = frozen(out_features, in_features // tp.world_size, dtype=dtype)
        _no_scale(self)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        out = linear(x, self.weight, self.weight_scale_inv)
        return self.tp.all_reduce(out) if reduce else out


class VocabParallelEmbedding(nn.Module):
    """Rows split by vocab: at k3 size (163840 x 7168) a replica is 2.3 GB in bf16 per rank."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.start, self.rows = tp.shard(vocab_size)
        self.weight = frozen(self.rows, hidden_size, dtype=dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.world_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mine = (local >= 0) & (local < self.rows)
        out = F.embedding(local.clamp(0, self.rows - 1), self.weight)
        out = out * mine.unsqueeze(-1).to(out.dtype)
        return self.tp.all_reduce(out)


class ParallelLMHead(nn.Module):
    """Vocab-sharded lm_head; logits are gathered so every rank holds the full fp32 row.

    With tied embeddings the weight is the embedding's parameter, read at call time (not
    registered here) so a pool that swaps the embedding's storage is followed automatically.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup, dtype: torch.dtype,
                 tied_to: VocabParallelEmbedding | None = None):
        super().__init__()
        self.tp = tp
        self._tied = (tied_to,) if tied_to is not None else None
        if tied_to is None:
            self.weight = frozen(vocab_size // tp.world_size, hidden_size, dtype=dtype)

    def shard_weight(self) -> torch.Tensor:
        return self._tied[0].weight if self._tied is not None else self.weight

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = linear(hidden, self.shard_weight()).float()
        return self.tp.all_gather(logits, dim=-1)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


@fused
def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """Kimi's SiTU: beta*tanh(gate/beta)*sigmoid(gate), times up (soft-clipped to linear_beta when
    set), in fp32 like vLLM's reference op: the clip is what keeps bf16 activations bounded."""
    g, u = gate.float(), up.float()
    g = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (g * u).to(gate.dtype)


def act_params(cfg: ModelConfig) -> tuple[str, float, float | None]:
    """(hidden_act, SiTU beta, SiTU linear_beta) as the fused kernels take them."""
    if cfg.hidden_act != "situ":
        return cfg.hidden_act, 1.0, None
    linear_beta = cfg.activation_situ_linear_beta
    return "situ", float(cfg.activation_situ_beta or 1.0), float(linear_beta) if linear_beta is not None else None


def act_and_mul(cfg: ModelConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The gated activation of every MLP and expert of a model (`hidden_act`)."""
    if cfg.hidden_act == "situ":
        beta, linear_beta = float(cfg.activation_situ_beta or 1.0), cfg.activation_situ_linear_beta
        return lambda gate, up: situ_and_mul(gate, up, beta, linear_beta)
    if cfg.hidden_act == "silu":
        return silu_and_mul
    raise ConfigError(f"hidden_act={cfg.hidden_act!r}: only 'silu' and 'situ' are supported")


class GatedMLP(nn.Module):
    """Dense MLP and shared experts: gate/up column-parallel, down row-parallel."""

    def __init__(self, cfg: ModelConfig, intermediate_size: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.act = act_and_mul(cfg)
        self.act_name, self.act_beta, self.act_linear_beta = act_params(cfg)
        # Gate rows, then up rows (this rank's shard of each): one GEMM for both.
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, 2 * intermediate_size, tp, dtype)
        self.shard = intermediate_size // tp.world_size
        self.down_proj = RowParallelLinear(intermediate_size, cfg.hidden_size, tp, dtype)

    def forward(self, x: torch.Tensor, reduce: bool = True) -> torch.Tensor:
        w = self.gate_up_proj.weight
        if gemv_gated.supported(x, w, self.act_name):  # one decode row: GEMV + activation, one kernel
            h = gemv.run(torch.ops.latentserve.gated_gemv, x, w, self.act_name, self.act_beta, self.act_linear_beta)
            if h is not None:
                return self.down_proj(h, reduce=reduce)
        gate_up = self.gate_up_proj(x)
        return self.down_proj(self.act(gate_up[..., : self.shard], gate_up[..., self.shard:]), reduce=reduce)


# ---- rotary embedding ---------------------------------------------------------------------

def rope_parameters(cfg: ModelConfig) -> dict:
    """The rope settings of a config, in transformers 5's `rope_parameters` form.

    Accepts both spellings found in config.json files: `rope_parameters` (transformers 5 writes
    it, and drops the top-level rope_theta) and the older `rope_theta` + `rope_scaling`.
    """
    params = cfg.extra.get("rope_parameters")
    if params:
        params = dict(params)
        params.setdefault("rope_theta", cfg.rope_theta)
    else:
        params = dict(cfg.extra.get("rope_scaling") or {})
        params["rope_theta"] = cfg.rope_theta
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] not in ("default", "yarn"):
        raise ConfigError(f"rope type {params['rope_type']!r} is not implemented (only default and yarn)")
    if params["rope_type"] == "yarn":
        params.setdefault("original_max_position_embeddings", cfg.max_position_embeddings)
    return params


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def softmax_scale(cfg: ModelConfig) -> float:
    """qk_head_dim**-0.5, times yarn's mscale(factor, mscale_all_dim)**2 as DeepSeek does."""
    scale = cfg.qk_head_dim ** -0.5
    p = rope_parameters(cfg)
    if p["rope_type"] != "default" and p.get("mscale_all_dim"):
        m = _yarn_mscale(p["factor"], p["mscale_all_dim"])
        scale *= m * m
    return scale


def _inv_freq_and_scaling(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Same float32 arithmetic as transformers 5.19, so fp32 tables are bit-identical."""
    p = rope_parameters(cfg)
    dim, base = cfg.qk_rope_head_dim, p["rope_theta"]
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)
    if p["rope_type"] == "default":
        return 1.0 / pos_freqs, 1.0
    factor = p.get("factor")
    orig = p["original_max_position_embeddings"]
    if factor is None:
        factor = cfg.max_position_embeddings / orig
    scaling = p.get("attention_factor")
    if scaling is None:
        mscale, mscale_all = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all:
            scaling = float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all))
        else:
            scaling = _yarn_mscale(factor)
    beta_fast, beta_slow = p.get("beta_fast") or 32, p.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, scaling


class RotaryEmbedding(KeepFloat32, nn.Module):
    """cos/sin table [max_positions, 2, rope_dim/2] in fp32, a non-parameter buffer that
    `reset_buffers` recomputes in place (after a pool swaps in its own storage)."""

    fp32_tensors = ("cos_sin",)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.interleave = bool(cfg.rope_interleave)
        self.max_positions = cfg.max_position_embeddings
        self.register_buffer("cos_sin", torch.empty(self.max_positions, 2, cfg.qk_rope_head_dim // 2,
                                                    dtype=torch.float32), persistent=False)
        self.reset_buffers()

    def _after_fp32_restore(self) -> None:
        self.reset_buffers()

    @torch.no_grad()
    def reset_buffers(self) -> None:
        if self.cos_sin.is_meta:
            return
        inv_freq, scaling = _inv_freq_and_scaling(self.cfg)
        freqs = torch.arange(self.max_positions).float()[:, None] * inv_freq[None, :]
        table = torch.stack([freqs.cos() * scaling, freqs.sin() * scaling], dim=1)
        self.cos_sin.copy_(table)

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cs = self.cos_sin[positions]
        return cs[:, 0], cs[:, 1]


@fused
def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [T, ..., r]; cos/sin [T, r/2]. DeepSeek's interleaved pairs (x0,x1),(x2,x3)... come out
    de-interleaved, exactly like transformers' apply_rotary_pos_emb_interleave; q and k share
    the layout, so the attention scores are those of the original formulation."""
    half = x.shape[-1] // 2
    if interleave:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x[..., :half], x[..., half:]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos = cos.view(shape).to(x.dtype)
    sin = sin.view(shape).to(x.dtype)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def cat_last(parts: list[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """torch.cat along the last dim, into `out` when given (never out=None, which torch.compile
    traces as an argument)."""
    return torch.cat(parts, dim=-1) if out is None else torch.cat(parts, dim=-1, out=out)
