"""External anchor: transformers 5.19's DeepseekV3ForCausalLM and our model agree, both ways.

(a) a checkpoint we write (latent MoE off) loads in transformers: same greedy tokens;
(b) a randomly initialised transformers model, save_pretrained, loads in ours: same tokens;
(c) our paged-KV path (chunked prefill, mixed prefill/decode batches) gives the greedy tokens
    of the cache-less full recompute.
Greedy loops recompute everything each step (no cache) in fp32.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _model_utils import (
    PagedRunner,
    assert_same_greedy,
    build_model,
    full_logits,
    greedy_full,
    prompts,
)

from service.config import PRESETS, ModelConfig
from service.parallel import TPGroup
from service.weights import load_checkpoint, write_dummy_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

transformers = pytest.importorskip("transformers")

STEPS = 16
N_PROMPTS = 8




def hf_logits_fn(hf):
    @torch.inference_mode()
    def fn(tokens: list[int]) -> torch.Tensor:
        return hf(torch.tensor([tokens]), use_cache=False).logits[0].float()
    return fn


def ours_logits_fn(model):
    return lambda tokens: full_logits(model, tokens)


def greedy_all(fn, ps: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    runs = [greedy_full(fn, p, STEPS) for p in ps]
    return [r[0] for r in runs], [r[1] for r in runs]


def assert_not_degenerate(tokens: list[list[int]]) -> None:
    flat = [t for seq in tokens for t in seq]
    assert len(set(flat)) >= 8, f"degenerate greedy output (too few distinct tokens): {tokens}"
    assert len({tuple(s) for s in tokens}) == len(tokens), "every prompt generated the same tokens"



def _assert_matches_hf(hf, ours, ps):
    """Prompt logits agree and cache-less greedy tokens match; returns transformers' (tokens, margins)."""
    diff = (hf_logits_fn(hf)(ps[0]) - full_logits(ours, ps[0])).abs().max().item()
    assert diff < 1e-4, f"prompt logits differ by {diff}"
    ref, margins = greedy_all(hf_logits_fn(hf), ps)
    assert_not_degenerate(ref)
    mine, _ = greedy_all(ours_logits_fn(ours), ps)
    assert assert_same_greedy(ref, margins, mine) >= N_PROMPTS - 1
    return ref, margins

def test_our_checkpoint_runs_in_transformers(tmp_path):
    cfg = PRESETS["tiny-dense-moe"]
    write_dummy_checkpoint(cfg, str(tmp_path), seed=3, dtype=torch.float32, max_shard_bytes=1 << 20)
    hf = transformers.DeepseekV3ForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32).eval()
    ours = build_model(cfg, seed=None)
    load_checkpoint(ours, cfg, TPGroup.single(), str(tmp_path), progress=False)

    ps = prompts(N_PROMPTS, cfg.vocab_size, seed=1)
    ref, margins = _assert_matches_hf(hf, ours, ps)
    # The paged path too, against transformers directly.
    paged = PagedRunner(ours, num_blocks=96, block_size=4).greedy(ps, STEPS)
    assert assert_same_greedy(ref, margins, paged) >= N_PROMPTS - 1


HF_VARIANTS = {
    # DeepSeek-V3 / Kimi layout: q_lora, interleaved rope with yarn scaling, grouped routing.
    "qlora-yarn-groups": dict(
        q_lora_rank=32, rope_interleave=True, n_group=4, topk_group=2, norm_topk_prob=True,
        n_shared_experts=1, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1}),
    # The other branches: q_proj, non-interleaved rope, tied embeddings, 2 shared experts.
    "qproj-rotatehalf-tied": dict(
        q_lora_rank=None, rope_interleave=False, n_group=2, topk_group=1, norm_topk_prob=False,
        n_shared_experts=2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
}


@pytest.mark.parametrize("variant", sorted(HF_VARIANTS))
def test_transformers_checkpoint_runs_in_ours(tmp_path, variant):
    hf_cfg = transformers.DeepseekV3Config(
        vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=16, num_hidden_layers=3,
        first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16,
        num_experts_per_tok=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
        routed_scaling_factor=2.5, max_position_embeddings=256, initializer_range=0.02,
        num_nextn_predict_layers=0, **HF_VARIANTS[variant])
    torch.manual_seed(7)
    hf = transformers.DeepseekV3ForCausalLM(hf_cfg).float().eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(11)
        for name, buf in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=g) * 0.05)  # transformers leaves it at zero
    hf.save_pretrained(str(tmp_path))

    cfg = ModelConfig.load(str(tmp_path))
    assert not cfg.is_latent
    ours = build_model(cfg, seed=None)
    load_checkpoint(ours, cfg, TPGroup.single(), str(tmp_path), progress=False)

    ps = prompts(N_PROMPTS, cfg.vocab_size, seed=2, hi=40)  # long enough for yarn's ramp to matter
    _assert_matches_hf(hf, ours, ps)


@pytest.mark.parametrize("preset,latent_norm", [("tiny", True), ("tiny", False)])
def test_paged_kv_matches_full_recompute(preset, latent_norm):
    cfg = dataclasses.replace(PRESETS[preset], latent_moe_use_norm=latent_norm)
    model = build_model(cfg, seed=5)
    ps = prompts(N_PROMPTS, cfg.vocab_size, seed=4, hi=14)
    ref, margins = greedy_all(ours_logits_fn(model), ps)
    assert_not_degenerate(ref)
    for block_size, chunk in ((4, 5), (16, 64)):
        runner = PagedRunner(model, num_blocks=128, block_size=block_size, seed=block_size)
        paged = runner.greedy(ps, STEPS, prefill_chunk=chunk)
        assert assert_same_greedy(ref, margins, paged) >= N_PROMPTS - 1, (block_size, chunk)
        # Logits too, not just argmaxes: the full recompute of the paged run's own tokens.
        for p, toks, rows in zip(ps, paged, runner.logits):
            full = full_logits(model, p + toks[:-1])[len(p) - 1:]
            diff = (torch.stack(rows) - full).abs().max().item()
            assert diff < 1e-4, f"paged logits differ from the full recompute by {diff}"


def test_unimplemented_rope_scaling_is_a_clear_error():
    from service.config import ConfigError

    cfg = dataclasses.replace(PRESETS["tiny"], extra={"rope_scaling": {"type": "longrope", "factor": 2.0}})
    with pytest.raises(ConfigError, match="longrope"):
        build_model(cfg, seed=None)
