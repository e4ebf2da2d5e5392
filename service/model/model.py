"""The causal LM we serve, with tensor parallelism: DeepSeek-V3 with our latent MoE, or Kimi-K3
as vLLM defines it (KDA and MLA layers, latent MoE, SiTU, attention residuals).

Parameter names follow the checkpoint's, except routed experts, which are held fused per layer
(`mlp.experts.w1/w3/w2`) and Kimi's `block_sparse_moe`, held as `mlp`; `service.weights` maps
between the two.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..config import ModelConfig
from ..parallel import TPGroup
from ..tail.base import TailRunner
from . import add_norm, fp8
from .attention import MLAAttention
from .attn_metadata import AttnMetadata
from .attn_res import attn_res_mix
from .layers import (
    GatedMLP,
    ParallelLMHead,
    ReplicatedLinear,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
)
from .moe import MoE

# Kimi-K3's decode kernels, on by default since run 61 (bench/RESULTS.md: together 0.71-0.80x of
# the path without them); each switch at `0` turns one off, all four give that path (`fla`).
K3_DECODE_SWITCHES = ("LATENTSERVE_KDA_DECODE_STEP", "LATENTSERVE_GEMV_MULTI", "LATENTSERVE_ATTN_RES_KERNEL",
                      "LATENTSERVE_MLA_GATE_IN_KERNEL")

class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, layer_idx: int, dtype: torch.dtype,
                 tail: TailRunner | None):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_kda = cfg.is_kda_layer(layer_idx)
        if self.is_kda:
            from .kda import KimiDeltaAttention

            self.self_attn = KimiDeltaAttention(cfg, tp, layer_idx, dtype)
        else:
            self.self_attn = MLAAttention(cfg, tp, layer_idx, dtype)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = MoE(cfg, tp, layer_idx, dtype, tail)
        else:
            self.mlp = GatedMLP(cfg, cfg.intermediate_size, tp, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.attn_res = cfg.attn_res_block_size is not None
        if self.attn_res:
            bs, h = cfg.attn_res_block_size, cfg.hidden_size
            # Layers 0, bs, 2bs, ... close the running block: its sum joins the bank as a source.
            self.block_write = layer_idx // bs if layer_idx % bs == 0 else -1
            self.prev_blocks = -(-layer_idx // bs)
            self.self_attention_res_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
            self.self_attention_res_proj = ReplicatedLinear(h, 1, dtype)
            self.mlp_res_norm = RMSNorm(h, cfg.rms_norm_eps, dtype)
            self.mlp_res_proj = ReplicatedLinear(h, 1, dtype)

    def attend(self, x: torch.Tensor, rope: tuple, meta: AttnMetadata, cache) -> torch.Tensor:
        if self.is_kda:
            return self.self_attn(x, meta, cache)
        return self.self_attn(x, *rope, meta, cache)

    def project(self, x: torch.Tensor, rope: tuple, into: tuple | None = None) -> tuple[tuple, torch.Tensor | None]:
        """Attention's per-token part: (its inputs, the output gate), for `self_attn.attend` and
        `self_attn.output` (prefill_graphs.py runs the three apart)."""
        if self.is_kda:
            return self.self_attn.project(x, into)
        return self.self_attn.project(x, *rope, into=into)

    def forward(self, h: torch.Tensor, rope: tuple, meta: AttnMetadata, cache,
                pending: torch.Tensor | None = None, bank: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, pending) -> (h, pending): the residual stream and the last sublayer's output, not
        yet added to it. The next layer (or the final norm) adds it, in the kernel of its input
        norm when layers are compiled: one launch a layer fewer than an add of its own (as vLLM's
        fused add-norm). With attention residuals they are the running block sum and its next
        term, and `bank` holds the finished blocks."""
        folded = self._folded_attention(h, pending, rope, meta, cache)
        if folded is None:
            h, x = self.enter(h, pending, bank)
            folded = h, self.attend(x, rope, meta, cache)
        return self.leave(*folded, bank)

    def _folded_attention(self, h: torch.Tensor, pending: torch.Tensor | None, rope: tuple, meta: AttnMetadata,
                          cache) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(h + pending, attention's output) with the add and the input norm inside fused_qkv_a's
        GEMV (add_norm.py: one row, LATENTSERVE_FOLD_ADD_NORM), or None where it does not run."""
        attn = self.self_attn
        if self.attn_res or self.is_kda or not attn.takes_qkv_a():
            return None
        weight, norm = attn.fused_qkv_a_proj.weight, self.input_layernorm
        if not add_norm.gemv_supported(h, pending, weight):
            return None
        out = add_norm.run(torch.ops.latentserve.gemv_add_norm, h, pending, norm.weight, norm.eps, weight)
        if out is None:
            return None
        qkv_a, h = out
        return h, attn(h, *rope, meta, cache, qkv_a=qkv_a)

    def enter(self, h: torch.Tensor, pending: torch.Tensor | None, bank: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stream with `pending` added, and attention's input."""
        if self.attn_res:
            # Each sublayer's input is a learned softmax mix of the bank's block sums and the
            # running block sum (attn_res.py); layer 0, bs, 2bs, ... closes the running block.
            return attn_res_mix(h, pending, bank, self.prev_blocks, self.self_attention_res_norm,
                                self.self_attention_res_proj, self.input_layernorm, write_block=self.block_write)
        if pending is not None:
            h = h + pending
        return h, self.input_layernorm(h)

    def leave(self, h: torch.Tensor, attn_out: torch.Tensor, bank: torch.Tensor | None
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """After attention: its output into the stream, then the MLP (or MoE), whose output is the
        new `pending`."""
        if self.attn_res:
            if self.block_write >= 0:  # a new block starts with this attention output
                h, attn_out = attn_out, None
            h, x = attn_res_mix(h, attn_out, bank, self.prev_blocks + (self.block_write >= 0), self.mlp_res_norm,
                                self.mlp_res_proj, self.post_attention_layernorm)
            return h, self.mlp(x)
        folded = self.mlp.folded(h, attn_out, self.post_attention_layernorm) if isinstance(self.mlp, MoE) else None
        if folded is not None:
            return folded
        h = h + attn_out
        return h, self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup, dtype: torch.dtype,
                 tail_factory: Callable[[int], TailRunner] | None):
        super().__init__()
        self.config = cfg
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, tp, i, dtype,
                         tail_factory(i) if tail_factory is not None and cfg.is_moe_layer(i) and cfg.is_latent
                         else None)
            for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        # Kimi's MLA layers are NoPE and its KDA layers have no positions: no rope table then.
        self.rotary_emb = None if cfg.mla_use_nope else RotaryEmbedding(cfg)
        self.attn_res = cfg.attn_res_block_size is not None
        if self.attn_res:
            self.output_attn_res_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
            self.output_attn_res_proj = ReplicatedLinear(cfg.hidden_size, 1, dtype)

    def check(self, meta: AttnMetadata, caches: list | None) -> None:
        if meta.max_position >= self.config.max_position_embeddings:
            raise ValueError(f"position {meta.max_position} is beyond max_position_embeddings="
                             f"{self.config.max_position_embeddings}")
        if caches is not None and len(caches) != len(self.layers):
            raise ValueError(f"got {len(caches)} caches for {len(self.layers)} layers")

    def rope(self, positions: torch.Tensor) -> tuple:
        return self.rotary_emb.lookup(positions) if self.rotary_emb is not None else (None, None)

    def forward(self, input_ids: torch.Tensor, meta: AttnMetadata, caches: list | None) -> torch.Tensor:
        self.check(meta, caches)
        rope = self.rope(meta.positions)
        h = self.embed_tokens(input_ids)
        bank = self.new_bank(h)
        cache = (lambda i: caches[i]) if caches is not None else (lambda i: None)
        pending = None
        for i, layer in enumerate(self.layers):
            h, pending = layer(h, rope, meta, cache(i), pending, bank)
        return self.final(h, pending, bank)

    def new_bank(self, h: torch.Tensor) -> torch.Tensor | None:
        """Attention residuals' bank of finished block sums [T, blocks, H], or None."""
        if not self.attn_res:
            return None
        return h.new_empty(h.shape[0], -(-self.config.num_hidden_layers // self.config.attn_res_block_size), h.shape[1])

    def final(self, h: torch.Tensor, pending: torch.Tensor | None, bank: torch.Tensor | None) -> torch.Tensor:
        """The last layer's (h, pending) -> the final hidden states."""
        if not self.attn_res:
            return self.norm(h, add=pending)
        _, h = attn_res_mix(h, pending, bank, bank.shape[1], self.output_attn_res_norm, self.output_attn_res_proj, None)
        return self.norm(h)


class CausalLM(nn.Module):
    """`model(input_ids [T], meta, caches) -> hidden [T, H]`; `compute_logits(hidden [B, H])`
    -> fp32 logits [B, vocab], full vocab on every rank. `caches[i]` is layer i's paged MLA KV
    cache or its KDA state (`kda.KDAState`); None runs cache-less (every chunk from position 0).

    `dtype` defaults to torch's default dtype; building with the serving dtype avoids a
    `.to(dtype)` pass (which also works: fp32-only tensors stay fp32).
    """

    def __init__(self, cfg: ModelConfig, tp: TPGroup, tail_factory: Callable[[int], TailRunner] | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__()
        cfg.validate(tp.world_size)
        dtype = dtype or torch.get_default_dtype()
        self.config = cfg
        self.tp = tp
        self.model = DecoderModel(cfg, tp, dtype, tail_factory)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype, tied_to=tied)
        fp8.quantize_parameters(self, cfg, tp.world_size)  # FP8 block-scaled checkpoints only

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    @property
    def dtype(self) -> torch.dtype:
        return self.model.norm.weight.dtype

    def forward(self, input_ids: torch.Tensor, meta: AttnMetadata, kv_caches: list | None = None) -> torch.Tensor:
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
