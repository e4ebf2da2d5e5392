"""DeepSeek multi-head latent attention (MLA) over a paged cache of the compressed KV.

Per layer the cache is `[num_blocks, block_size, kv_lora_rank + qk_rope_head_dim]` holding
[normed c_kv | roped k_pe] for every token, replicated on every TP rank (it has no head dim).

Prefill chunks expand the cached latents to per-head keys/values (cheap when the chunk is
long); single-token chunks (decodes) run batched in the absorbed form, where the query is
moved into the latent space (q_nope . W_UK) and the output comes back through W_UV, so the
context is read once as latents and never expanded.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from ..config import ConfigError, ModelConfig
from ..parallel import TPGroup
from . import cpu_kernels, gemv_multi, mla_absorb, mla_decode, mla_merge, qb_norms, sdpa
from .attn_metadata import AttnMetadata
from .layers import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RMSNorm,
    RowParallelLinear,
    apply_rope,
    cat_last,
    softmax_scale,
)


def _write_kv(kv_cache: torch.Tensor, slots: torch.Tensor, latent: torch.Tensor) -> None:
    kv_cache.view(-1, kv_cache.shape[-1]).index_copy_(0, slots, latent.to(kv_cache.dtype))


@torch.library.custom_op("latentserve::write_kv", mutates_args=("kv_cache",))
def _write_kv_op(kv_cache: torch.Tensor, slots: torch.Tensor, latent: torch.Tensor) -> None:
    _write_kv(kv_cache, slots, latent)


@_write_kv_op.register_fake
def _(kv_cache, slots, latent) -> None:
    return None


CPU_SCORES = 1 << 20  # attention scores per SDPA batch of whole prompts on a CPU


def write_kv(kv_cache: torch.Tensor, slots: torch.Tensor, latent: torch.Tensor) -> None:
    """Each token's [c_kv | k_pe] into its cache slot. Under torch.compile (decoder layers
    compiled inside the CUDA graphs) the write is an opaque op that mutates the cache: traced as
    a view's index_copy_ that a later kernel (MLA decode) reads, Inductor functionalized it into
    an out-of-place copy of the whole cache plus a copy back, two ~140 us kernels per layer on
    the H200 (bench/RESULTS.md, 2026-12-03), which made compiled layers 2x slower than eager."""
    if torch.compiler.is_compiling():
        torch.ops.latentserve.write_kv(kv_cache, slots, latent)
    else:
        _write_kv(kv_cache, slots, latent)


def kv_cache_shape(cfg: ModelConfig, num_blocks: int, block_size: int) -> tuple[int, int, int]:
    return (num_blocks, block_size, cfg.kv_cache_dim)


class MLAAttention(nn.Module):
    """Heads split across TP ranks: q_b/q_proj, kv_b (and Kimi's output gate g_proj)
    column-parallel by head, o_proj row-parallel with an all-reduce; the a-projections and their
    norms are replicated. Kimi's MLA layers use no rotary embedding (`mla_use_nope`): the
    qk_rope_head_dim part of q and of the shared key is then plain content."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup, layer_idx: int, dtype: torch.dtype):
        super().__init__()
        if cfg.attention_bias:
            raise ConfigError("attention_bias=True is not supported (DeepSeek-V3 has no attention biases)")
        self.layer_idx = layer_idx
        self.num_heads = cfg.num_attention_heads // tp.world_size
        self.nope, self.rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
        self.v_dim, self.kv_lora_rank = cfg.v_head_dim, cfg.kv_lora_rank
        self.qk_dim = cfg.qk_head_dim
        self.interleave = bool(cfg.rope_interleave)
        self.use_rope = not cfg.mla_use_nope
        self.scale = softmax_scale(cfg)
        h, n = cfg.hidden_size, cfg.num_attention_heads
        self.q_lora_rank = cfg.q_lora_rank
        if cfg.q_lora_rank:
            # q_a and kv_a (with the shared rope key) read the same input: one GEMM.
            self.fused_qkv_a_proj = ReplicatedLinear(h, cfg.q_lora_rank + cfg.kv_cache_dim, dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, cfg.latent_norm_eps, dtype)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, n * self.qk_dim, tp, dtype)
        else:
            self.q_proj = ColumnParallelLinear(h, n * self.qk_dim, tp, dtype)
            self.kv_a_proj_with_mqa = ReplicatedLinear(h, cfg.kv_cache_dim, dtype)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, cfg.latent_norm_eps, dtype)
        self.kv_b_proj = ColumnParallelLinear(cfg.kv_lora_rank, n * (self.nope + self.v_dim), tp, dtype)
        self.o_proj = RowParallelLinear(n * self.v_dim, h, tp, dtype)
        self.g_proj = ColumnParallelLinear(h, n * self.v_dim, tp, dtype) if cfg.mla_use_output_gate else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, meta: AttnMetadata,
                kv_cache: torch.Tensor | None, qkv_a: torch.Tensor | None = None) -> torch.Tensor:
        """qkv_a: fused_qkv_a's output, computed by the caller (model.DecoderLayer's add-norm fold,
        where `takes_qkv_a`); x then gives only the rows, dtype and device."""
        kernels = self._absorbed_kernels(x, meta, kv_cache)
        rope = (cos, sin, self.interleave) if kernels and self._rope_in_decode() else None
        gate_in_kernel = kernels and self._gate_in_decode(x.shape[0])
        inputs, gate = self.project(x, cos, sin, rope_q=rope is None, gate_sigmoid=not gate_in_kernel, qkv_a=qkv_a)
        out = self.attend(*inputs, meta, kv_cache, rope=rope, gate=gate if gate_in_kernel else None)
        return self.output(out, None if gate_in_kernel else gate)

    def _absorbed_kernels(self, x: torch.Tensor, meta: AttnMetadata, kv_cache: torch.Tensor | None) -> bool:
        """This step's attention is a decode-only step on the absorbed Triton kernels."""
        return kv_cache is not None and not meta.prefill_chunks and self._kernels_take(x, meta, kv_cache)

    def _kernels_take(self, t: torch.Tensor, meta: AttnMetadata, kv_cache: torch.Tensor) -> bool:
        """The absorb and MLA decode kernels take decodes of t's dtype and device (q, or the layer's
        input) against this cache."""
        return (meta.decode_context_lens is not None and mla_absorb.supported(t, self.kv_b_proj.weight)
                and mla_decode.supported(t, kv_cache, self.kv_lora_rank))

    def _rope_in_decode(self) -> bool:
        """On the absorbed kernels, q_pe is roped inside the MLA decode kernel where it is loaded:
        no rope-and-cat kernel over q (LATENTSERVE_MLA_ROPE_IN_DECODE=1, opt-in until bench/gpu.py's
        `rope_in_decode` times it)."""
        return self.use_rope and os.environ.get("LATENTSERVE_MLA_ROPE_IN_DECODE", "0") == "1"

    def _gate_in_decode(self, rows: int) -> bool:
        """On the absorbed kernels, Kimi's output gate is applied in W_UV's kernel (`absorb_out`'s
        epilogue, sigmoid included) instead of a kernel before o_proj (on by default since run 61;
        LATENTSERVE_MLA_GATE_IN_KERNEL=0 turns it off; not where merge_out runs W_UV)."""
        return (self.g_proj is not None and os.environ.get("LATENTSERVE_MLA_GATE_IN_KERNEL", "1") == "1"
                and rows > mla_merge.merge_out_max_rows())

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                into: tuple[torch.Tensor, torch.Tensor] | None = None, rope_q: bool = True, gate_sigmoid: bool = True,
                qkv_a: torch.Tensor | None = None) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor | None]:
        """x [T, H] -> ((q [T, heads, qk], latent [T, kv_cache_dim] as the cache holds it), Kimi's
        output gate [T, heads * v] or None): the per-token part before attention, which depends on
        the token count only (prefill_graphs.py captures it). `into`: buffers for q and latent
        (`step_buffers`). rope_q=False leaves q's rope part unroped (`_rope_in_decode`);
        gate_sigmoid=False returns the gate before its sigmoid (`_gate_in_decode`)."""
        q_out, latent_out = into if into is not None else (None, None)
        t = x.shape[0]
        gate_in = None
        if self.q_lora_rank:
            qkv_a, gate_in = (qkv_a, None) if qkv_a is not None else self._down_and_gate(x)
            fused = self._q_and_latent(qkv_a, cos, sin) if into is None else None
            if fused is not None:  # one launch: q_a's norm, q_b, and the latent row (qb_norms.py)
                q, latent = fused
                q = q.view(t, self.num_heads, self.qk_dim)
                if self.use_rope and rope_q:
                    q = cat_last([q[..., : self.nope], apply_rope(q[..., self.nope:], cos, sin, self.interleave)])
                return (q, latent), None
            q_a, c_kv, k_pe = qkv_a.split([self.q_lora_rank, self.kv_lora_rank, self.rope], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        else:
            q = self.q_proj(x)
            c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        q = q.view(t, self.num_heads, self.qk_dim)
        if self.use_rope:
            if rope_q:
                q = cat_last([q[..., : self.nope], apply_rope(q[..., self.nope:], cos, sin, self.interleave)], q_out)
            k_pe = apply_rope(k_pe, cos, sin, self.interleave)
        if q_out is not None and not (self.use_rope and rope_q):
            q = q_out.copy_(q)
        latent = cat_last([self.kv_a_layernorm(c_kv), k_pe], latent_out)
        gate = None
        if self.g_proj is not None:
            gate = gate_in if gate_in is not None else self.g_proj(x)
            gate = gate.sigmoid() if gate_sigmoid else gate
        return (q, latent), gate

    def _q_and_latent(self, qkv_a: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q [1, heads * qk], the latent row) from fused_qkv_a's row in q_b's launch (qb_norms.py),
        or None where it does not run (more rows, an output gate, an FP8 q_b)."""
        w = self.q_b_proj.weight
        if (self.g_proj is not None or self.q_b_proj.weight_scale_inv is not None
                or not qb_norms.supported(qkv_a, self.q_lora_rank, self.kv_lora_rank, self.rope, w)):
            return None
        rope = (2 if self.interleave else 1) if self.use_rope else 0
        return qb_norms.run(qkv_a, self.q_a_layernorm.weight, self.q_a_layernorm.eps, w, self.kv_a_layernorm.weight,
                            self.kv_a_layernorm.eps, cos if rope else qkv_a, sin if rope else qkv_a, rope)

    def takes_qkv_a(self) -> bool:
        """fused_qkv_a's output is all `project` needs of x: q in LoRA form, no output gate, 16/32-bit."""
        return bool(self.q_lora_rank) and self.g_proj is None and self.fused_qkv_a_proj.weight_scale_inv is None

    def _down_and_gate(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """fused_qkv_a's output, and Kimi's output gate projection when both come from one
        gemv_multi launch (a decode step's rows, LATENTSERVE_GEMV_MULTI=1), else None for it."""
        mods = [self.fused_qkv_a_proj, self.g_proj]
        if self.g_proj is not None and all(m.weight_scale_inv is None for m in mods):
            weights = [m.weight for m in mods]
            y = gemv_multi.run(x, weights) if gemv_multi.supported(x, weights) else None
            if y is not None:
                n = weights[0].shape[0]
                return y[..., :n], y[..., n:]
        return self.fused_qkv_a_proj(x), None

    def step_buffers(self, n: int, dtype: torch.dtype, device) -> tuple[tuple, torch.Tensor]:
        """Zeroed buffers for `project`'s attention inputs and `attend`'s output, n rows."""
        inputs = (torch.zeros(n, self.num_heads, self.qk_dim, dtype=dtype, device=device),
                  torch.zeros(n, self.kv_lora_rank + self.rope, dtype=dtype, device=device))
        return inputs, torch.zeros(n, self.num_heads, self.v_dim, dtype=dtype, device=device)

    def output(self, out: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
        """Attention output [T, heads, v] -> [T, H] through the output gate and o_proj."""
        out = out.reshape(out.shape[0], self.num_heads * self.v_dim)
        if gate is not None:
            out = out * gate
        return self.o_proj(out)

    def attend(self, q: torch.Tensor, latent: torch.Tensor, meta: AttnMetadata, kv_cache: torch.Tensor | None,
               out: torch.Tensor | None = None, rope: tuple | None = None,
               gate: torch.Tensor | None = None) -> torch.Tensor:
        """The step's attention proper: q [T, heads, qk] over the cached context and this step's
        latents (written to the cache here) -> [T, heads, v], into `out` when given. It depends on
        the chunks' lengths and positions, so it always runs eagerly. rope (cos, sin, interleave):
        q's rope part is still to be roped; gate [T, heads * v]: Kimi's output gate before its
        sigmoid, applied here (both decode-only steps: `_rope_in_decode`, `_gate_in_decode`)."""
        t = q.shape[0]
        given = out is not None
        if out is None:
            out = q.new_empty(t, self.num_heads, self.v_dim)
        qsl = meta.query_starts
        if kv_cache is None:
            # Cache-less reference mode: every chunk attends to its own tokens only.
            for i in range(len(meta.query_lens)):
                if meta.start_positions[i] != 0:
                    raise ValueError("without a KV cache every chunk must start at position 0")
                s, e = qsl[i], qsl[i + 1]
                out[s:e] = self._expanded(q[s:e], latent[s:e], 0)
            return out
        if meta.slot_mapping is None:
            raise ValueError("the chunks' block tables do not cover their context: cannot use the KV cache")
        writes = self._decode_writes_kv(q, kv_cache, meta)
        if not writes:
            write_kv(kv_cache, meta.slot_mapping, latent)
        if not meta.prefill_chunks:  # decodes only (token i is decode i): no gather, no scatter
            decoded = self._absorbed_decode(q, kv_cache, meta, latent if writes else None, rope, gate)
            return out.copy_(decoded) if given else decoded
        if meta.decode_token_idx.numel():
            out[meta.decode_token_idx] = self._absorbed_decode(q[meta.decode_token_idx], kv_cache, meta)
        groups, others, span = meta.prefill_groups()
        if groups:
            self._whole_prompts(q, latent, kv_cache.dtype, out, groups, span)
        for i in others:
            s, e = qsl[i], qsl[i + 1]
            nblocks = -(-meta.context_lens_list[i] // meta.block_size)
            ctx = kv_cache[meta.block_tables[i, :nblocks]].view(-1, kv_cache.shape[-1])
            ctx = ctx[: meta.context_lens_list[i]].to(q.dtype)
            out[s:e] = self._expanded(q[s:e], ctx, meta.start_positions[i])
        return out

    def _expanded(self, q: torch.Tensor, latent: torch.Tensor, start: int) -> torch.Tensor:
        """q [n, heads, qk] at positions start.. attend over latent [S = start + n, kv_cache_dim]."""
        k, v = self._keys_values(latent)
        return self._attend(q[None], k[None], v[None], start)[0]

    def _whole_prompts(self, q: torch.Tensor, latent: torch.Tensor, cache_dtype: torch.dtype, out: torch.Tensor,
                       groups: list[tuple], span: tuple[int, int]) -> None:
        """Prompts whole in this step attend to their own tokens only: their keys come from this
        step's latents (rounded as the cache holds them) through one kv_b GEMM over the span the
        prompts cover, and prompts of one length attend as one batch, so a layer's launches do
        not grow with the number of prompts. One gather, GEMM and SDPA per prompt made mixed
        steps of 64 decodes and a few prompts take ~0.6 s on the H200 (bench/RESULTS.md)."""
        lo, hi = span
        lat = latent[lo:hi]
        if cache_dtype != lat.dtype:
            lat = lat.to(cache_dtype).to(lat.dtype)
        k, v = self._keys_values(lat)
        for length, firsts, idx, rel in groups:
            n = len(firsts)
            # On a CPU SDPA's math path holds a batch's scores: batches sized to keep them in
            # cache (64 prompts of 128 in one batch ran 0.6x the per-prompt path's speed).
            per = n if q.is_cuda else max(1, CPU_SCORES // (length * length * self.num_heads))
            for j in range(0, n, per):
                m = min(per, n - j)
                if idx is None:  # back to back: views, no gather
                    s, e = firsts[j], m * length
                    dst, qs, ks, vs = slice(s, s + e), q[s:s + e], k[s - lo:s - lo + e], v[s - lo:s - lo + e]
                else:
                    dst, r = idx[j * length:(j + m) * length], rel[j * length:(j + m) * length]
                    qs, ks, vs = q[dst], k[r], v[r]
                o = self._attend(qs.view(m, length, *q.shape[1:]), ks.view(m, length, *k.shape[1:]),
                                 vs.reshape(m, length, *v.shape[1:]), 0)
                out[dst] = o.reshape(m * length, *o.shape[2:])

    def _keys_values(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [S, kv_cache_dim] -> per-head keys [S, heads, qk] and values [S, heads, v]."""
        s = latent.shape[0]
        kv = self.kv_b_proj(latent[:, : self.kv_lora_rank]).view(s, self.num_heads, self.nope + self.v_dim)
        k_pe = latent[:, None, self.kv_lora_rank:].expand(s, self.num_heads, self.rope)
        return torch.cat([kv[..., : self.nope], k_pe], dim=-1), kv[..., self.nope:]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int) -> torch.Tensor:
        """q [b, n, heads, qk] at positions start.. over k [b, S = start + n, heads, qk] and v
        [b, S, heads, v] -> [b, n, heads, v]."""
        n, s = q.shape[1], k.shape[1]
        # 4-D [b, heads, tokens, dim]: SDPA's fused kernels (flash, memory-efficient) take only
        # 4-D inputs; 3-D ones went to its math path, in fp32, 115 of a 188 ms 8 x 1024 prefill
        # on the H200.
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if start == 0 and s == n:
            return sdpa.causal(q, k, v, self.scale).transpose(1, 2)
        # Bottom-right causal: query i (position start + i) sees keys 0..start + i.
        mask = torch.arange(s, device=q.device)[None, :] <= (start + torch.arange(n, device=q.device))[:, None]
        return sdpa.masked(q, k, v, mask, self.scale).transpose(1, 2)

    def _decode_writes_kv(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttnMetadata) -> bool:
        """A step of decodes only on the Triton kernel: it writes the step's KV rows itself, one
        launch fewer than write_kv (LATENTSERVE_MLA_WRITE_KV=0 keeps write_kv: a bench baseline)."""
        return (not meta.prefill_chunks and meta.decode_context_lens is not None and meta.slot_mapping is not None
                and os.environ.get("LATENTSERVE_MLA_WRITE_KV", "1") != "0"
                and mla_decode.supported(q, kv_cache, self.kv_lora_rank))

    def _absorbed_decode(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttnMetadata,
                         new_kv: torch.Tensor | None = None, rope: tuple | None = None,
                         gate: torch.Tensor | None = None) -> torch.Tensor:
        """q [B, heads, qk] (one token per sequence) against its whole cached context. new_kv
        (`_decode_writes_kv`): the step's latents, not yet in the cache; the kernel writes them.
        rope: q's rope part is unroped; the decode kernel ropes it (any other path here, now).
        gate: the output gate before its sigmoid, applied in W_UV's kernel (any other path here)."""
        b = q.shape[0]
        new = {} if new_kv is None else {"new_kv": new_kv.to(kv_cache.dtype), "new_slots": meta.slot_mapping}
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope:]
        if self._kernels_take(q, meta, kv_cache):
            # Four kernels (three at one split) where the bmm path took seven (mla_absorb.py):
            # q_latent and q_pe go to the attention kernel as two inputs, its fp32 output to o_proj's rows.
            q_latent = torch.ops.latentserve.mla_absorb_q(q[..., : self.nope], w_uk)
            merge_out = b <= mla_merge.merge_out_max_rows()  # the splits' merge and W_UV in one kernel
            o = mla_decode.mla_decode(q_latent, kv_cache, meta.decode_block_tables, meta.decode_context_lens,
                                      self.kv_lora_rank, self.scale, q_pe=q[..., self.nope:],
                                      w_uv=w_uv if merge_out else None, rope=rope, **new)
            if not merge_out:
                o, gate = torch.ops.latentserve.mla_absorb_out(o, w_uv, gate), None
        else:
            o = self._decoded_by_torch(q, kv_cache, meta, new, rope, w_uk, w_uv)
        if gate is not None:  # not applied in W_UV's kernel
            o = o.reshape(b, -1) * gate.sigmoid()
        return o.reshape(b, self.num_heads, self.v_dim)

    def _decoded_by_torch(self, q: torch.Tensor, kv_cache: torch.Tensor, meta: AttnMetadata, new: dict,
                          rope: tuple | None, w_uk: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
        """_absorbed_decode off the absorb kernels: bmm's for W_UK and W_UV around the decode kernel,
        the C kernel (CPU fp32) or torch's attention over the gathered context."""
        b = q.shape[0]
        if rope is not None:
            q = torch.cat([q[..., : self.nope], apply_rope(q[..., self.nope:], *rope)], dim=-1)
        q_latent = torch.bmm(q[..., : self.nope].transpose(0, 1), w_uk).transpose(0, 1)  # [B, heads, kv_lora]
        # [c_kv | k_pe] rows match [q_latent | q_pe]: one matmul scores both parts.
        q_cat = torch.cat([q_latent, q[..., self.nope:]], dim=-1)
        if meta.decode_context_lens is not None and mla_decode.supported(q_cat, kv_cache, self.kv_lora_rank):
            o_latent = mla_decode.mla_decode(q_cat, kv_cache, meta.decode_block_tables, meta.decode_context_lens,
                                             self.kv_lora_rank, self.scale, **new).to(q.dtype)
            return torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        if meta.decode_slots is None:
            raise ValueError("decode metadata without decode_slots needs the Triton decode kernel")
        if meta.decode_context_lens is not None:  # CPU fp32: the C kernel reads the cache in place
            o_latent = cpu_kernels.mla_decode(q_cat, kv_cache, meta.decode_slots, meta.decode_context_lens,
                                              self.kv_lora_rank, self.scale)
            if o_latent is not None:
                return torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)
        # Exactly the context's slots (padding repeats a written slot, so no stale or poisoned
        # value is read and nothing needs zeroing); the bias masks the padding.
        flat = kv_cache.view(-1, kv_cache.shape[-1])
        ctx = flat.index_select(0, meta.decode_slots.view(-1)).view(b, -1, flat.shape[-1]).to(q.dtype)
        scores = torch.baddbmm(meta.decode_bias, q_cat.float(), ctx.float().transpose(1, 2), alpha=self.scale)
        probs = scores.softmax(dim=-1).to(q.dtype)
        o_latent = torch.bmm(probs, ctx[..., : self.kv_lora_rank])  # [B, heads, kv_lora]
        return torch.bmm(o_latent.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [B, heads, v]
