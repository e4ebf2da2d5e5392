"""Kimi-K3's own parts, whole model, against an independent float64 reference at TP 1 and TP 2.

The reference below is written from vLLM's Kimi-K3 (models/kimi_k3/amd/linear.py, mla.py,
ops/attn_res.py; model_executor/layers/activation.py SituAndMul; fused_moe grouped_topk) and
shares no code with `service/`: its own checkpoint-name table, MLA with NoPE and the output
gate, SiTU MLPs and experts, sigmoid/softmax grouped routing with the correction bias, the
latent MoE (down-proj -> experts -> routed_expert_norm -> up-proj, shared experts on the full
hidden) and attention residuals (block bank, running block sum, softmax over the sources scored
by proj . RMSNorm(source), a block closed every attn_res_block_size layers, the output mix before
the final norm). Only MLA layers: every layer is in `full_attn_layers`, so no KDA is needed.

Weights are full float64 tensors in checkpoint names, drawn here at larger than init scale;
the model (fp32) loads them through `service.weights.load_weights` at TP 1 and TP 2.
"""

from __future__ import annotations

import dataclasses
import math
import os

import pytest
import torch
from _model_utils import PagedRunner, build_model, full_logits, run_tp

from service.config import PRESETS, ModelConfig
from service.parallel import TPGroup
from service.weights import expected_weights, load_weights

pytestmark = pytest.mark.usefixtures("one_thread")

LAYERS = 5  # attention-residual blocks close at layers 0, 2, 4: three blocks and an open one
TOLERANCE = 1e-5  # max |ours - reference| / max |reference| over the logits


def _mla_only(base: ModelConfig, layers: int, **changes) -> ModelConfig:
    lac = dict(base.linear_attn_config)
    lac.update(kda_layers=[], full_attn_layers=list(range(1, layers + 1)))
    return dataclasses.replace(base, num_hidden_layers=layers, linear_attn_config=lac, **changes)


K3 = PRESETS["k3-tiny"]
CONFIGS = {
    # Latent MoE with its norm, SiTU with both betas, sigmoid grouped routing, q_lora, 1 shared.
    "latent-norm-sigmoid": _mla_only(K3, LAYERS),
    # No latent norm (routed_scaling_factor then shows), SiTU without the up clip, softmax
    # routing, q_proj instead of q_lora, 2 shared experts, no renormalisation.
    "latent-nonorm-softmax": _mla_only(
        K3, LAYERS, latent_moe_use_norm=False, activation_situ_linear_beta=None, scoring_func="softmax",
        q_lora_rank=None, n_shared_experts=2, norm_topk_prob=False),
}
# The same with the latent norm on, so the variant's other paths are checked against the model
# while the no-norm case is a known disagreement (NO_LATENT_NORM_BUG below).
CONFIGS["latent-norm-softmax"] = dataclasses.replace(CONFIGS["latent-nonorm-softmax"],
                                                    latent_moe_use_norm=True)
SEQUENCES = [[5, 900, 17, 333, 42, 600, 7, 81, 1000, 256, 12, 77, 501, 9],
             [700, 3, 64, 999, 128, 45, 310, 8, 222]]


# ---- the checkpoint, as vLLM's Kimi loader names it ---------------------------------------------

def is_moe_layer(cfg: ModelConfig, i: int) -> bool:
    return cfg.n_routed_experts > 0 and i >= cfg.first_k_dense_replace and i % cfg.moe_layer_freq == 0


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    h, n, v = cfg.hidden_size, cfg.num_attention_heads, cfg.vocab_size
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    lat = cfg.moe_latent_size or h
    inter, shared = cfg.moe_intermediate_size, cfg.moe_intermediate_size * cfg.n_shared_experts
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        if cfg.q_lora_rank:
            out[a + "q_a_proj.weight"] = (cfg.q_lora_rank, h)
            out[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
            out[a + "q_b_proj.weight"] = (n * qk, cfg.q_lora_rank)
        else:
            out[a + "q_proj.weight"] = (n * qk, h)
        out[a + "kv_a_proj_with_mqa.weight"] = (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h)
        out[a + "kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
        out[a + "kv_b_proj.weight"] = (n * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
        out[a + "o_proj.weight"] = (h, n * cfg.v_head_dim)
        if cfg.mla_use_output_gate:
            out[a + "g_proj.weight"] = (n * cfg.v_head_dim, h)
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        for sub in ("self_attention", "mlp"):
            out[p + f"{sub}_res_norm.weight"] = (h,)
            out[p + f"{sub}_res_proj.weight"] = (1, h)
        if not is_moe_layer(cfg, i):
            out[p + "mlp.gate_proj.weight"] = (cfg.intermediate_size, h)
            out[p + "mlp.up_proj.weight"] = (cfg.intermediate_size, h)
            out[p + "mlp.down_proj.weight"] = (h, cfg.intermediate_size)
            continue
        m = p + "block_sparse_moe."
        out[m + "gate.weight"] = (cfg.n_routed_experts, h)
        out[m + "gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
        for j in range(cfg.n_routed_experts):
            out[m + f"experts.{j}.w1.weight"] = (inter, lat)
            out[m + f"experts.{j}.w3.weight"] = (inter, lat)
            out[m + f"experts.{j}.w2.weight"] = (lat, inter)
        out[m + "shared_experts.gate_proj.weight"] = (shared, h)
        out[m + "shared_experts.up_proj.weight"] = (shared, h)
        out[m + "shared_experts.down_proj.weight"] = (h, shared)
        out[m + "routed_expert_down_proj.weight"] = (lat, h)
        if cfg.latent_moe_use_norm:
            out[m + "routed_expert_norm.weight"] = (lat,)
        out[m + "routed_expert_up_proj.weight"] = (h, lat)
    out["model.output_attn_res_norm.weight"] = (h,)
    out["model.output_attn_res_proj.weight"] = (1, h)
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (v, h)
    return out


def draw_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Float64, larger than init scale: gate/up projections at gain 2 so SiTU's tanh clips
    bite, norms around 1 with spread, the router bias large enough to change choices. (Larger
    gains make the fp32 model's rounding grow towards TOLERANCE over the layers.)"""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, shape in sorted(checkpoint_shapes(cfg).items()):
        if name.endswith("e_score_correction_bias"):
            span = 0.4 if cfg.scoring_func == "sigmoid" else 0.1
            out[name] = (torch.rand(shape, generator=g, dtype=torch.float64) - 0.5) * span
        elif len(shape) == 1:
            out[name] = 1.0 + 0.2 * torch.randn(shape, generator=g, dtype=torch.float64)
        elif name == "model.embed_tokens.weight":
            out[name] = torch.randn(shape, generator=g, dtype=torch.float64)
        else:
            gain = 2.0 if name.endswith(("gate_proj.weight", "up_proj.weight", "w1.weight", "w3.weight")) \
                else 0.5 if name.endswith("_res_proj.weight") else 1.0
            out[name] = gain * torch.randn(shape, generator=g, dtype=torch.float64) / shape[1] ** 0.5
    return out


# ---- the float64 reference ------------------------------------------------------------------------

def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    y = x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def act_and_mul(cfg: ModelConfig, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SituAndMul: beta*tanh(gate/beta)*sigmoid(gate) * (linear_beta*tanh(up/linear_beta) or up)."""
    if cfg.hidden_act == "silu":
        return gate * torch.sigmoid(gate) * up
    beta = cfg.activation_situ_beta or 1.0
    gate = beta * torch.tanh(gate / beta) * torch.sigmoid(gate)
    if cfg.activation_situ_linear_beta is not None:
        lb = cfg.activation_situ_linear_beta
        up = lb * torch.tanh(up / lb)
    return gate * up


def gated_mlp(cfg, w, prefix: str, x: torch.Tensor) -> torch.Tensor:
    return act_and_mul(cfg, x @ w[prefix + "gate_proj.weight"].T, x @ w[prefix + "up_proj.weight"].T) \
        @ w[prefix + "down_proj.weight"].T


def mla(cfg: ModelConfig, w: dict, a: str, x: torch.Tensor) -> torch.Tensor:
    t, n, eps = x.shape[0], cfg.num_attention_heads, cfg.rms_norm_eps
    nope, rope, vd = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    if cfg.q_lora_rank:
        q_latent = rms_norm(x @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"], eps)
        q = q_latent @ w[a + "q_b_proj.weight"].T
    else:
        q = x @ w[a + "q_proj.weight"].T
    q = q.view(t, n, nope + rope)
    kv = x @ w[a + "kv_a_proj_with_mqa.weight"].T
    latent, k_pe = kv[:, :cfg.kv_lora_rank], kv[:, cfg.kv_lora_rank:]
    kvb = rms_norm(latent, w[a + "kv_a_layernorm.weight"], eps) @ w[a + "kv_b_proj.weight"].T
    kvb = kvb.view(t, n, nope + vd)
    k = torch.cat([kvb[..., :nope], k_pe[:, None, :].expand(t, n, rope)], dim=-1)  # NoPE: no rotation
    v = kvb[..., nope:]
    scores = torch.einsum("qhd,khd->hqk", q, k) * (nope + rope) ** -0.5
    causal = torch.ones(t, t, dtype=torch.bool).triu(1)
    probs = scores.masked_fill(causal, -math.inf).softmax(-1)
    o = torch.einsum("hqk,khd->qhd", probs, v).reshape(t, n * vd)
    if cfg.mla_use_output_gate:
        o = o * torch.sigmoid(x @ w[a + "g_proj.weight"].T)
    return o @ w[a + "o_proj.weight"].T


def route(cfg: ModelConfig, w: dict, m: str, x: torch.Tensor, use_bias: bool = True,
          use_groups: bool = True) -> torch.Tensor:
    """Dense routing weights [T, E]: zero for the experts not chosen."""
    logits = x @ w[m + "gate.weight"].T
    scores = logits.softmax(-1) if cfg.scoring_func == "softmax" else torch.sigmoid(logits)
    choice = scores + w[m + "gate.e_score_correction_bias"] if use_bias else scores.clone()
    e, groups = cfg.n_routed_experts, cfg.n_group
    if use_groups and groups > 1:
        per = e // groups
        group_score = choice.view(-1, groups, per).topk(2, dim=-1).values.sum(-1)  # top-2 sum per group
        kept = torch.zeros_like(group_score, dtype=torch.bool)
        kept.scatter_(1, group_score.topk(cfg.topk_group, dim=-1).indices, True)
        choice = choice.masked_fill(~kept.repeat_interleave(per, dim=1), -math.inf)
    ids = choice.topk(cfg.num_experts_per_tok, dim=-1).indices
    weights = scores.gather(1, ids)  # the unbiased scores
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return torch.zeros_like(scores).scatter(1, ids, weights * cfg.routed_scaling_factor)


def moe(cfg: ModelConfig, w: dict, m: str, x: torch.Tensor) -> torch.Tensor:
    dense_weights = route(cfg, w, m, x)
    u = x @ w[m + "routed_expert_down_proj.weight"].T if cfg.moe_latent_size else x
    routed = torch.zeros_like(u)
    for j in range(cfg.n_routed_experts):
        e = f"{m}experts.{j}."
        y = act_and_mul(cfg, u @ w[e + "w1.weight"].T, u @ w[e + "w3.weight"].T) @ w[e + "w2.weight"].T
        routed = routed + dense_weights[:, j:j + 1] * y
    if cfg.moe_latent_size:
        if cfg.latent_moe_use_norm:
            routed = rms_norm(routed, w[m + "routed_expert_norm.weight"], cfg.rms_norm_eps)
        routed = routed @ w[m + "routed_expert_up_proj.weight"].T
    return routed + gated_mlp(cfg, w, m + "shared_experts.", x)


def res_mix(w: dict, prefix: str, sources: list[torch.Tensor], eps: float) -> torch.Tensor:
    """Attention residuals: softmax over the sources of proj . RMSNorm(source) (`prefix`_norm,
    `prefix`_proj); the raw sources mixed with those weights."""
    stack = torch.stack(sources, dim=1)  # [T, S, H]
    scores = rms_norm(stack, w[prefix + "_norm.weight"], eps) @ w[prefix + "_proj.weight"][0]  # [T, S]
    return (scores.softmax(-1)[..., None] * stack).sum(1)


def reference_logits(cfg: ModelConfig, w: dict, tokens: list[int], trace: dict | None = None) -> torch.Tensor:
    """Float64 logits [len, vocab]. `trace[i]` gets MoE layer i's input. The block bookkeeping is
    vLLM's KimiDecoderLayer.forward_attn_residual and KimiLinearModel.forward (amd/linear.py:672-727,
    875-915), with the in-place prefix/delta sums written out as one running sum."""
    eps, bs = cfg.rms_norm_eps, cfg.attn_res_block_size
    emb = w["model.embed_tokens.weight"][torch.tensor(tokens)]
    blocks: list[torch.Tensor] = []  # closed block sums; block 0 is the embeddings
    running = emb  # the open block's sum of sublayer outputs
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        if i % bs == 0:  # close the block: it becomes a source in its own right, a new one opens
            blocks.append(running)
            running = None
        sources = blocks if running is None else blocks + [running]
        x = rms_norm(res_mix(w, p + "self_attention_res", sources, eps), w[p + "input_layernorm.weight"], eps)
        attn = mla(cfg, w, p + "self_attn.", x)
        running = attn if running is None else running + attn
        mix = res_mix(w, p + "mlp_res", blocks + [running], eps)
        x = rms_norm(mix, w[p + "post_attention_layernorm.weight"], eps)
        if is_moe_layer(cfg, i):
            if trace is not None:
                trace[i] = x
            out = moe(cfg, w, p + "block_sparse_moe.", x)
        else:
            out = gated_mlp(cfg, w, p + "mlp.", x)
        running = running + out
    assert len(blocks) == -(-cfg.num_hidden_layers // bs)
    h = res_mix(w, "model.output_attn_res", blocks + [running], eps)  # no output norm: model.norm follows
    return rms_norm(h, w["model.norm.weight"], eps) @ w["lm_head.weight"].T


def relative_error(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours.double() - ref).abs().max() / ref.abs().max()).item()


# ---- the reference's own checks ------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_checkpoint_names_are_the_models(name):
    """The name table above (from vLLM's loader) is the one our model loads."""
    cfg = CONFIGS[name]
    mine, ours = checkpoint_shapes(cfg), expected_weights(cfg)
    assert sorted(set(mine) ^ set(ours)) == []
    assert {n: s for n, s in mine.items() if tuple(ours[n]) != s} == {}


# Each group of tensors (and config knobs) must move the logits far beyond TOLERANCE, or a model
# that dropped the term would pass.
PERTURBED = ("self_attention_res_norm", "self_attention_res_proj", "mlp_res_norm", "mlp_res_proj",
             "output_attn_res_norm", "output_attn_res_proj", "input_layernorm", "post_attention_layernorm",
             "model.norm", "g_proj", "q_a_layernorm", "self_attn.q_proj", "kv_a_layernorm", "kv_b_proj",
             "kv_a_proj_with_mqa", "routed_expert_down_proj", "routed_expert_norm", "routed_expert_up_proj",
             "shared_experts", "experts.3.w3", "e_score_correction_bias", "mlp.up_proj")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_term_matters(name):
    cfg, base = CONFIGS[name], draw_weights(CONFIGS[name])
    tokens = SEQUENCES[0]
    ref = reference_logits(cfg, base, tokens)
    g = torch.Generator().manual_seed(5)
    weak = {}
    for key in PERTURBED:
        names = [n for n in base if key in n]
        if not names:  # tensors this variant does not have
            assert {"routed_expert_norm": not cfg.latent_moe_use_norm, "q_a_layernorm": not cfg.q_lora_rank,
                    "self_attn.q_proj": bool(cfg.q_lora_rank)}.get(key), key
            continue
        w = dict(base)
        for n in names:
            noise = torch.randn(base[n].shape, generator=g, dtype=torch.float64)
            w[n] = base[n] + 0.1 * base[n].abs().mean() * noise
        err = relative_error(reference_logits(cfg, w, tokens), ref)
        if err < 100 * TOLERANCE:
            weak[key] = err
    knobs = {"activation_situ_beta": 2.0, "activation_situ_linear_beta": 3.0, "n_group": 1}
    if not cfg.latent_moe_use_norm:
        knobs["routed_scaling_factor"] = 1.5
    for knob, value in knobs.items():
        err = relative_error(reference_logits(dataclasses.replace(cfg, **{knob: value}), base, tokens), ref)
        if err < 100 * TOLERANCE:
            weak[knob] = err
    assert weak == {}, f"terms the test data cannot see: {weak}"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_bias_and_groups_change_expert_choices(name):
    cfg, w = CONFIGS[name], draw_weights(CONFIGS[name])
    trace: dict[int, torch.Tensor] = {}
    reference_logits(cfg, w, SEQUENCES[0], trace)
    assert sorted(trace) == [i for i in range(LAYERS) if is_moe_layer(cfg, i)] and len(trace) >= 3

    def chosen(**kw):
        return [(route(cfg, w, f"model.layers.{i}.block_sparse_moe.", x, **kw) != 0).tolist()
                for i, x in trace.items()]
    assert chosen() != chosen(use_bias=False)
    assert chosen() != chosen(use_groups=False)


# ---- our model against it ------------------------------------------------------------------------

def our_logits(cfg: ModelConfig, tp: TPGroup | None) -> list[torch.Tensor]:
    model = build_model(cfg, tp, dtype=torch.float32, seed=None)
    load_weights(model, cfg, tp or TPGroup.single(), draw_weights(cfg))
    return [full_logits(model, seq) for seq in SEQUENCES]


def assert_matches_reference(label: str, cfg: ModelConfig, ours: list[torch.Tensor]) -> float:
    w = draw_weights(cfg)
    worst = 0.0
    for seq, logits in zip(SEQUENCES, ours):
        err = relative_error(logits, reference_logits(cfg, w, seq))
        assert err < TOLERANCE, f"{label}: relative error {err:.2e} against the float64 reference"
        worst = max(worst, err)
    return worst


MODEL_CASES = sorted(CONFIGS)


@pytest.mark.parametrize("name", MODEL_CASES)
def test_tp1_matches_reference(name):
    cfg = CONFIGS[name]
    assert_matches_reference(f"{name} at TP 1", cfg, our_logits(cfg, None))


def test_paged_decode_matches_reference():
    """The paged path (KV cache, chunked prefill, decode steps) with attention residuals: its
    logits are the reference's full recompute of the same tokens."""
    cfg = CONFIGS["latent-norm-sigmoid"]
    w = draw_weights(cfg)
    model = build_model(cfg, seed=None)
    load_weights(model, cfg, TPGroup.single(), w)
    runner = PagedRunner(model, num_blocks=64, block_size=4)
    prompts = [s[:6] for s in SEQUENCES]
    out = runner.greedy(prompts, 5, prefill_chunk=4)
    for p, toks, rows in zip(prompts, out, runner.logits):
        ref = reference_logits(cfg, w, p + toks[:-1])[len(p) - 1:]
        err = relative_error(torch.stack(rows), ref)
        assert err < TOLERANCE, f"paged logits: relative error {err:.2e} against the reference"


def tp_worker(tp: TPGroup, out_dir: str) -> None:
    torch.save({name: our_logits(cfg, tp) for name, cfg in CONFIGS.items()},
               os.path.join(out_dir, f"rank{tp.rank}.pt"))


@pytest.fixture(scope="module")
def tp2_logits(tmp_path_factory) -> list[dict]:
    """Both configs on 2 ranks (one spawn for the module): per rank {config: [logits]}."""
    out = tmp_path_factory.mktemp("k3_tp2")
    run_tp(2, str(out), tp_worker, str(out))
    return [torch.load(out / f"rank{r}.pt") for r in range(2)]


@pytest.mark.parametrize("name", MODEL_CASES)
def test_tp2_matches_reference(tp2_logits, name):
    for r, results in enumerate(tp2_logits):
        assert_matches_reference(f"{name} at TP 2, rank {r}", CONFIGS[name], results[name])
