"""Kimi-K3-style latent-MoE causal LM, DeepSeek-V3 compatible, with tensor parallelism.

Parameter names are Hugging Face DeepSeek-V3 names, except routed experts, which are held
fused per layer (`mlp.experts.w1/w3/w2`); `service.weights` maps between the two.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..config import ConfigError, ModelConfig
from ..parallel import TPGroup
from ..tail.base import TailRunner
from .attention import AttnMetadata, MLAAttention
from .layers import ParallelLMHead, RMSNorm, RotaryEmbedding, SwiGLUMLP, VocabParallelEmbedding
from .moe import MoE


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, layer_idx: int, dtype: torch.dtype,
                 tail: TailRunner | None):
        super().__init__()
        self.layer_idx = layer_idx
        self.self_attn = MLAAttention(cfg, tp, layer_idx, dtype)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = MoE(cfg, tp, layer_idx, dtype, tail)
        else:
            self.mlp = SwiGLUMLP(cfg.hidden_size, cfg.intermediate_size, tp, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMetadata,
                kv_cache: torch.Tensor | None) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, meta, kv_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class DeepseekV3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype,
                 tail_factory: Callable[[int], TailRunner] | None):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, tp, i, dtype,
                         tail_factory(i) if tail_factory is not None and cfg.is_moe_layer(i) and cfg.is_latent
                         else None)
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(cfg)

    def forward(self, input_ids: torch.Tensor, meta: AttnMetadata,
                kv_caches: list[torch.Tensor] | None) -> torch.Tensor:
        if meta.max_position >= self.rotary_emb.max_positions:
            raise ValueError(f"position {meta.max_position} is beyond max_position_embeddings="
                             f"{self.rotary_emb.max_positions}")
        if kv_caches is not None and len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches for {len(self.layers)} layers")
        cos, sin = self.rotary_emb.lookup(meta.positions)
        h = self.embed_tokens(input_ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, meta, kv_caches[i] if kv_caches is not None else None)
        return self.norm(h)


class DeepseekV3ForCausalLM(nn.Module):
    """`model(input_ids [T], meta, kv_caches) -> hidden [T, H]`; `compute_logits(hidden [B, H])`
    -> fp32 logits [B, vocab], full vocab on every rank.

    `dtype` defaults to torch's default dtype; building with the serving dtype avoids a
    `.to(dtype)` pass (which also works: fp32-only tensors stay fp32).
    """

    def __init__(self, cfg: ModelConfig, tp: TPGroup, tail_factory: Callable[[int], TailRunner] | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        cfg.validate(tp.world_size)
        if cfg.hidden_act != "silu":
            raise ConfigError(f"hidden_act={cfg.hidden_act!r}: only 'silu' is supported")
        dtype = dtype or torch.get_default_dtype()
        self.config = cfg
        self.tp = tp
        self.model = DeepseekV3Model(cfg, tp, dtype, tail_factory)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype, tied_to=tied)

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    def forward(self, input_ids: torch.Tensor, meta: AttnMetadata,
                kv_caches: list[torch.Tensor] | None = None) -> torch.Tensor:
        return self.model(input_ids, meta, kv_caches)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute every non-parameter buffer in place (after a pool swapped in storage)."""
        for m in self.modules():
            if m is not self and hasattr(m, "reset_buffers"):
                m.reset_buffers()

    def tail_runners(self) -> list[TailRunner]:
        return [layer.mlp.tail for layer in self.layers if isinstance(layer.mlp, MoE) and layer.mlp.tail is not None]
