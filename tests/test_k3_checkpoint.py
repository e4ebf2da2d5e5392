"""Kimi-K3 config.json and checkpoints: the kimi_linear keys and the kimi_k3 wrapper load, vLLM's
weight names round-trip with TP-invariant shards, and bad input is refused with the key named."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from _model_utils import build_model, full_logits, join_shards, params
from safetensors.torch import load_file, save_file

from service.config import PRESETS, ConfigError, ModelConfig, resolve_model
from service.parallel import TPGroup
from service.weights import (
    CheckpointError,
    checkpoint_tensors,
    expected_weights,
    load_checkpoint,
    write_dummy_checkpoint,
)

pytestmark = pytest.mark.usefixtures("one_thread")

K3 = PRESETS["k3-tiny"]


def test_kimi_config_keys_map_to_the_model_and_back():
    d = K3.to_dict()
    assert d["model_type"] == "kimi_linear" and d["architectures"] == ["KimiLinearForCausalLM"]
    assert d["num_experts"] == 16 and d["num_experts_per_token"] == 4 and d["routed_expert_hidden_size"] == 64
    assert d["moe_router_activation_func"] == "sigmoid" and d["num_expert_group"] == 4
    assert "n_routed_experts" not in d and "moe_latent_size" not in d
    assert ModelConfig.from_dict(d) == K3
    # KimiLinearConfig's own defaults apply to keys a config.json leaves out.
    bare = ModelConfig.from_dict({"model_type": "kimi_linear", "num_experts": 8, "num_experts_per_token": 2,
                                  "moe_intermediate_size": 16, "use_grouped_topk": False,
                                  "num_expert_group": 4, "topk_group": 2})
    assert (bare.n_group, bare.topk_group, bare.n_shared_experts, bare.routed_scaling_factor) == (1, 1, 0, 1.0)
    assert bare.moe_latent_size is None and bare.first_k_dense_replace == 0


def test_kimi_k3_wrapper_and_nested_hf_overrides(tmp_path):
    wrapped = dataclasses.replace(K3, num_hidden_layers=8, multimodal_wrapper={"vision_config": {"patch_size": 14}})
    d = wrapped.to_dict()
    assert d["model_type"] == "kimi_k3" and d["text_config"]["model_type"] == "kimi_linear"
    write_dummy_checkpoint(dataclasses.replace(wrapped, linear_attn_config={
        **K3.linear_attn_config, "kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8]}), str(tmp_path),
        dtype=torch.float32)
    # The seed's hf_overrides shape, nested as vLLM takes it for a multimodal config, or flat.
    for overrides in ({"text_config": {"num_hidden_layers": 4}}, {"num_hidden_layers": 4}):
        cfg, ckpt = resolve_model(str(tmp_path), overrides)
        assert cfg.num_hidden_layers == 4 and cfg.kda_layers == [0, 1, 2] and ckpt == str(tmp_path)


def test_dummy_init_is_tp_invariant_for_k3():
    full = params(build_model(K3, seed=0))
    ranks = [params(build_model(K3, TPGroup(r, 2, None), seed=0)) for r in range(2)]
    for name, t in full.items():
        assert torch.equal(join_shards(name, [r[name] for r in ranks], t.shape), t), name


def test_checkpoint_names_are_vllms_and_round_trip(tmp_path):
    names = set(expected_weights(K3))
    for want in ("model.layers.0.self_attn.q_conv1d.weight", "model.layers.0.self_attn.A_log",
                 "model.layers.0.self_attn.g_proj.weight", "model.layers.3.self_attn.g_proj.weight",
                 "model.layers.1.block_sparse_moe.experts.3.w1.weight",
                 "model.layers.1.block_sparse_moe.routed_expert_up_proj.weight",
                 "model.layers.2.self_attention_res_proj.weight", "model.output_attn_res_proj.weight"):
        assert want in names, want
    assert not any(".mlp.experts." in n or "gate_proj" in n and "block_sparse_moe.experts" in n for n in names)
    write_dummy_checkpoint(K3, str(tmp_path), seed=3, dtype=torch.float32, max_shard_bytes=256 << 10)
    for world in (1, 2):
        want = params(build_model(K3, TPGroup(world - 1, world, None), seed=3))
        tp = TPGroup(world - 1, world, None)
        model = build_model(K3, tp, seed=None)
        load_checkpoint(model, K3, tp, str(tmp_path), progress=False)
        for name, t in params(model).items():
            assert torch.equal(t, want[name]), name


def test_wrapped_checkpoint_spellings_mtp_and_vision_weights(tmp_path):
    """A kimi_k3 checkpoint: `language_model.model.` or vLLM's `language_model.layers.` names, the
    vision tower beside it, MTP layers after the last layer, transformers' 4-D A_log: all load."""
    cfg = dataclasses.replace(K3, multimodal_wrapper={"vision_config": {}})
    tensors = dict(checkpoint_tensors(K3, seed=5))
    renamed = {}
    for name, t in tensors.items():
        if name.startswith("model.layers.1."):
            name = "language_model." + name.removeprefix("model.")  # language_model.layers.1....
        else:
            name = "language_model." + name
        if name.endswith("layers.0.self_attn.A_log"):
            t = t.view(1, 1, -1, 1)
        renamed[name] = t.contiguous()
    renamed["vision_tower.patch_embed.proj.weight"] = torch.zeros(4, 4)
    renamed["mm_projector.proj.0.weight"] = torch.zeros(4, 4)
    renamed[f"language_model.model.layers.{K3.num_hidden_layers}.eh_proj.weight"] = torch.zeros(4, 4)  # MTP
    tmp_path.mkdir(exist_ok=True)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_dict()))
    loaded, _ = resolve_model(str(tmp_path))
    assert loaded == cfg
    model = build_model(cfg, seed=None)
    load_checkpoint(model, cfg, TPGroup.single(), str(tmp_path), progress=False)
    ref = build_model(K3, seed=5)
    assert torch.equal(full_logits(model, [3, 4, 5, 6]), full_logits(ref, [3, 4, 5, 6]))


def test_missing_kda_tensor_is_named_and_nothing_is_written(tmp_path):
    write_dummy_checkpoint(K3, str(tmp_path), seed=1, dtype=torch.float32)
    (shard,) = sorted(tmp_path.glob("model-*.safetensors"))
    tensors = load_file(str(shard))
    del tensors["model.layers.2.self_attn.dt_bias"]
    save_file(tensors, str(shard))
    model = build_model(K3, seed=7)
    before = params(model)
    with pytest.raises(CheckpointError, match=r"missing \(1\): model.layers.2.self_attn.dt_bias"):
        load_checkpoint(model, K3, TPGroup.single(), str(tmp_path), progress=False)
    assert all(torch.equal(t, before[n]) for n, t in params(model).items())


@pytest.mark.parametrize("change,key", [
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(linear_attn_config={**K3.linear_attn_config, "full_attn_layers": []}), "in neither: [4]"),
    (dict(linear_attn_config={**K3.linear_attn_config, "full_attn_layers": [3, 4]}), "in both: [3]"),
    (dict(scoring_func="sqrtsoftplus"), "moe_router_activation_func='sqrtsoftplus'"),
])
def test_bad_config_names_the_key(change, key):
    with pytest.raises(ConfigError) as info:
        dataclasses.replace(K3, **change).validate()
    assert key in str(info.value)


def test_cli_refuses_a_bad_kimi_config_with_exit_2(tmp_path):
    d = K3.to_dict()
    d["linear_attn_config"] = {**d["linear_attn_config"], "kda_layers": [1, 2]}
    (tmp_path / "config.json").write_text(json.dumps(d))
    r = subprocess.run([sys.executable, "-m", "service.cli", "generate", "--model", str(tmp_path), "--tp", "1",
                        "--distributed-executor-backend", "uni", "--prompt", "hi"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "linear_attn_config.kda_layers" in r.stderr and "in neither: [3]" in r.stderr
