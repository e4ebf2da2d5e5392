"""The MoE layer against an independent float64 reference of DESIGN §1, at TP 1 and TP 2.

The reference below shares no code with the model: its own sigmoid router with bias and group
limit, per-token SwiGLU experts, RMSNorm, latent up-projection and shared experts. Each rank
builds its shard from the same logical (HF-named) weights. The TP-2 run also checks the whole
model (dummy weights, cache-less and paged) against TP 1.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
from _model_utils import PagedRunner, build_model, full_logits, prompts, run_tp

from service.config import PRESETS, ModelConfig
from service.parallel import TPGroup
from service.weights import expected_weights, load_weights

pytestmark = pytest.mark.usefixtures("one_thread")

LAYER = 1  # first MoE layer of the tiny presets
TOKENS = 32

CONFIGS = {
    "latent-groups": PRESETS["tiny"],
    "latent-nonorm-nogroups": dataclasses.replace(
        PRESETS["tiny"], latent_moe_use_norm=False, n_group=1, topk_group=1, norm_topk_prob=False,
        n_shared_experts=2),
    "plain": PRESETS["tiny-dense-moe"],
}




# ---- logical weights and the reference ----------------------------------------------------------

def logical_moe_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full float64 tensors of layer LAYER's MLP, in HF names; larger than init scale so every
    term moves the output."""
    g = torch.Generator().manual_seed(seed)
    prefix = f"model.layers.{LAYER}.mlp."
    out = {}
    for name, shape in sorted(expected_weights(cfg).items()):
        if not name.startswith(prefix):
            continue
        if name.endswith("e_score_correction_bias"):
            out[name] = (torch.rand(shape, generator=g, dtype=torch.float64) - 0.5) * 0.4
        elif len(shape) == 1:
            out[name] = 1.0 + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)
        else:
            out[name] = torch.randn(shape, generator=g, dtype=torch.float64) / shape[1] ** 0.5
    return out


def ref_route(cfg: ModelConfig, w: dict, x: torch.Tensor, use_bias=True, use_groups=True):
    p = f"model.layers.{LAYER}.mlp."
    scores = torch.sigmoid(x @ w[p + "gate.weight"].T)
    choice = scores + (w[p + "gate.e_score_correction_bias"] if use_bias else 0)
    e, per = cfg.n_routed_experts, cfg.n_routed_experts // max(cfg.n_group, 1)
    if use_groups and cfg.n_group > 1:
        for t in range(x.shape[0]):
            groups = [sorted(choice[t, g * per:(g + 1) * per].tolist(), reverse=True) for g in range(cfg.n_group)]
            gscore = torch.tensor([gr[0] + gr[1] for gr in groups])
            kept = set(gscore.argsort(descending=True)[: cfg.topk_group].tolist())
            for j in range(e):
                if j // per not in kept:
                    choice[t, j] = -float("inf")
    ids = choice.argsort(dim=-1, descending=True)[:, : cfg.num_experts_per_tok]
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return weights * cfg.routed_scaling_factor, ids


def ref_swiglu(x, gate, up, down):
    a = x @ gate.T
    return (a * torch.sigmoid(a) * (x @ up.T)) @ down.T


def ref_latent_norm(x, weight, eps):
    """routed_expert_norm; none at all without latent_moe_use_norm (vLLM's Kimi-K3)."""
    if weight is None:
        return x
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def reference_moe(cfg: ModelConfig, w: dict, x: torch.Tensor) -> torch.Tensor:
    p = f"model.layers.{LAYER}.mlp."
    weights, ids = ref_route(cfg, w, x)
    r_in = x @ w[p + "routed_expert_down_proj.weight"].T if cfg.is_latent else x
    u = torch.zeros(x.shape[0], r_in.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for pj, j in zip(weights[t].tolist(), ids[t].tolist()):
            e = f"{p}experts.{j}."
            u[t] += pj * ref_swiglu(r_in[t], w[e + "gate_proj.weight"], w[e + "up_proj.weight"],
                                    w[e + "down_proj.weight"])
    if cfg.is_latent:
        norm = w.get(p + "routed_expert_norm.weight")
        routed = ref_latent_norm(u, norm, cfg.rms_norm_eps) @ w[p + "routed_expert_up_proj.weight"].T
    else:
        routed = u
    shared = ref_swiglu(x, w[p + "shared_experts.gate_proj.weight"], w[p + "shared_experts.up_proj.weight"],
                        w[p + "shared_experts.down_proj.weight"])
    return routed + shared


def layer_input(cfg: ModelConfig) -> torch.Tensor:
    return torch.randn(TOKENS, cfg.hidden_size, generator=torch.Generator().manual_seed(99), dtype=torch.float64)


def our_moe(cfg: ModelConfig, tp: TPGroup) -> torch.Tensor:
    model = build_model(cfg, tp, seed=None)
    load_weights(model, cfg, tp, logical_moe_weights(cfg))
    with torch.inference_mode():
        return model.layers[LAYER].mlp(layer_input(cfg).float()).double()


def assert_close_to_reference(name: str, cfg: ModelConfig, out: torch.Tensor) -> None:
    ref = reference_moe(cfg, logical_moe_weights(cfg), layer_input(cfg))
    err = (out - ref).abs().max().item() / ref.abs().max().item()
    assert err < 1e-5, f"{name}: relative error {err:.2e} against the float64 reference"


# ---- TP 1 ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_moe_matches_reference_tp1(name):
    cfg = CONFIGS[name]
    assert_close_to_reference(name, cfg, our_moe(cfg, TPGroup.single()))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_reference_exercises_bias_and_groups(name):
    """The test data make the bias (and group limit) change expert choices; else a model that
    ignored them would pass."""
    cfg = CONFIGS[name]
    w, x = logical_moe_weights(cfg), layer_input(cfg)
    chosen = {tuple(sorted(r)) for r in ref_route(cfg, w, x)[1].tolist()}
    unbiased = {tuple(sorted(r)) for r in ref_route(cfg, w, x, use_bias=False)[1].tolist()}
    assert chosen != unbiased
    if cfg.n_group > 1:
        ungrouped = {tuple(sorted(r)) for r in ref_route(cfg, w, x, use_groups=False)[1].tolist()}
        assert chosen != ungrouped


def test_tail_runners_are_the_latent_layers():
    latent = build_model(PRESETS["tiny"], seed=None)
    assert [r.layer_idx for r in latent.tail_runners()] == [
        i for i in range(PRESETS["tiny"].num_hidden_layers) if PRESETS["tiny"].is_moe_layer(i)]
    assert all(r.mode == "off" for r in latent.tail_runners())
    assert build_model(PRESETS["tiny-dense-moe"], seed=None).tail_runners() == []


# ---- TP 2 ------------------------------------------------------------------------------------

WHOLE_MODEL = PRESETS["tiny"]


def whole_model_outputs(tp: TPGroup | None) -> dict:
    model = build_model(WHOLE_MODEL, tp, seed=0)
    ps = prompts(3, WHOLE_MODEL.vocab_size, seed=8)
    return {"logits": full_logits(model, ps[0]),
            "paged": PagedRunner(model, num_blocks=64, block_size=4).greedy(ps, 6, prefill_chunk=4)}


def tp_worker(tp: TPGroup, out_dir: str) -> None:
    results = {name: our_moe(cfg, tp) for name, cfg in CONFIGS.items()}
    results["whole"] = whole_model_outputs(tp)
    torch.save(results, os.path.join(out_dir, f"rank{tp.rank}.pt"))


def test_tp2_matches_reference_and_tp1(tmp_path):
    run_tp(2, str(tmp_path), tp_worker, str(tmp_path))
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]
    for name, cfg in CONFIGS.items():
        for r in ranks:
            assert_close_to_reference(f"{name} at TP 2", cfg, r[name])
    tp1 = whole_model_outputs(None)
    for r in ranks:
        diff = (r["whole"]["logits"] - tp1["logits"]).abs().max().item()
        assert diff < 1e-4, f"TP 2 logits differ from TP 1 by {diff}"
        assert r["whole"]["paged"] == tp1["paged"]
