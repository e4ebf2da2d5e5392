"""Floating-point operations of one prefill step of an MLA model, counted from its config, for
bench/gpu.py's achieved-rate measure (issue 12: prefill of 8 x 1024 tokens against the measured
bf16 matmul rate).

Counted as the engine computes a prefill chunk that starts at position 0 (attention.py `_expanded`,
moe.py): 2 FLOPs per multiply-add of every dense projection (MLA q/kv a- and b-projections with
kv_b over the chunk's own latents, o_proj, Kimi's output gate; the dense MLP; the router, shared
experts, latent down/up projections), of the routed experts each token chose (top-k gate/up and
down in the latent width), of causal attention (QK^T over qk_nope + qk_rope, PV over v_head_dim,
only the (L + 1) L / 2 query-key pairs causality keeps, as FlashAttention counts them), and of
lm_head for the rows that need logits. Norms, rope, activations, the softmax and the top-k
selection are left out (elementwise: bandwidth, not matmul work). KDA layers are not counted.
"""

from __future__ import annotations

PARTS = ("attn_proj", "attention", "dense_mlp", "router", "shared_experts", "latent_proj", "routed_experts",
         "lm_head")


def linear(tokens: int, n_in: int, n_out: int) -> int:
    return 2 * tokens * n_in * n_out


def prefill_flops(cfg, seq_lens: list[int], logits_rows: int | None = None) -> dict[str, int]:
    """{part: FLOPs} of one step prefilling sequences of `seq_lens` tokens from position 0;
    `logits_rows` defaults to one per sequence (each chunk reaches its prompt's end)."""
    if cfg.kda_layers:
        raise ValueError("KDA layers are not counted: prefill_flops covers MLA models")
    t = sum(seq_lens)
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    nope, rope, v = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    out = dict.fromkeys(PARTS, 0)
    pairs = sum(n * (n + 1) // 2 for n in seq_lens)
    for layer in range(cfg.num_hidden_layers):
        if cfg.q_lora_rank:
            proj = linear(t, h, cfg.q_lora_rank + cfg.kv_cache_dim) + linear(t, cfg.q_lora_rank, heads * (nope + rope))
        else:
            proj = linear(t, h, heads * (nope + rope)) + linear(t, h, cfg.kv_cache_dim)
        proj += linear(t, cfg.kv_lora_rank, heads * (nope + v)) + linear(t, heads * v, h)
        if cfg.mla_use_output_gate:
            proj += linear(t, h, heads * v)
        out["attn_proj"] += proj
        out["attention"] += 2 * heads * pairs * (nope + rope + v)
        if not cfg.is_moe_layer(layer):
            out["dense_mlp"] += linear(t, h, 2 * cfg.intermediate_size) + linear(t, cfg.intermediate_size, h)
            continue
        out["router"] += linear(t, h, cfg.n_routed_experts)
        shared = cfg.moe_intermediate_size * cfg.n_shared_experts
        if shared:
            out["shared_experts"] += linear(t, h, 2 * shared) + linear(t, shared, h)
        width = cfg.moe_latent_size or h
        if cfg.moe_latent_size:
            out["latent_proj"] += linear(t, h, width) + linear(t, width, h)
        pairs_routed = t * cfg.num_experts_per_tok
        out["routed_experts"] += (linear(pairs_routed, width, 2 * cfg.moe_intermediate_size)
                                  + linear(pairs_routed, cfg.moe_intermediate_size, width))
    rows = len(seq_lens) if logits_rows is None else logits_rows
    out["lm_head"] = linear(rows, h, cfg.vocab_size)
    return out
