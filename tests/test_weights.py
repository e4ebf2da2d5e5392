"""Weights: TP-invariant dummy init, checkpoint round trips, and clear errors before any write."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch
from _model_utils import build_model, join_shards, params

from service.config import PRESETS
from service.parallel import TPGroup
from service.weights import (
    CheckpointError,
    check_weights,
    checkpoint_tensors,
    expected_weights,
    export_state,
    load_checkpoint,
    load_weights,
    save_checkpoint,
    write_dummy_checkpoint,
)

pytestmark = pytest.mark.usefixtures("one_thread")

TINY = PRESETS["tiny"]




def shards(cfg, world: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    # Building and initialising shards needs no collective, so no process group either.
    return [params(build_model(cfg, TPGroup(r, world, None), seed=seed)) for r in range(world)]


@pytest.mark.parametrize("preset,world", [("tiny", 2), ("tiny", 4), ("tiny-dense-moe", 2)])
def test_dummy_init_is_tp_invariant(preset, world):
    cfg = PRESETS[preset]
    full = params(build_model(cfg, seed=0))
    ranks = shards(cfg, world)
    for name, t in full.items():
        assert torch.equal(join_shards(name, [r[name] for r in ranks], t.shape), t), name


def test_dummy_init_scale_and_seed():
    model = build_model(TINY, seed=0)
    state = export_state(model)
    assert state.keys() == expected_weights(TINY).keys()
    logical = dict(checkpoint_tensors(TINY, seed=0))
    for name, t in state.items():
        assert torch.equal(t, logical[name].to(t.dtype)), name
        if name.endswith("e_score_correction_bias"):
            assert t.dtype == torch.float32 and 0 < t.abs().max() < 0.1
        elif t.dim() == 1:
            assert torch.equal(t, torch.ones_like(t)), name
        elif t.numel() > 1000:
            assert abs(t.std().item() - TINY.initializer_range) < 0.2 * TINY.initializer_range, name
    other = export_state(build_model(TINY, seed=1))
    assert not torch.equal(other["lm_head.weight"], state["lm_head.weight"])


def test_parameter_names_are_hf_names_with_fused_experts():
    names = {n for n, _ in build_model(TINY, seed=None).named_parameters()}
    hf = set(expected_weights(TINY))
    # The MLPs' gate and up are one gate_up_proj parameter (one GEMM), as the experts' w13, and
    # MLA's q_a and kv_a one fused_qkv_a_proj.
    fused = {n.replace("gate_proj", "gate_up_proj") for n in hf if n.endswith(".gate_proj.weight") and ".experts." not in n}
    fused |= {n.replace("q_a_proj", "fused_qkv_a_proj") for n in hf if n.endswith(".q_a_proj.weight")}
    plain = {n for n in hf if ".experts." not in n
             and not n.endswith((".gate_proj.weight", ".up_proj.weight", ".q_a_proj.weight", ".kv_a_proj_with_mqa.weight"))}
    assert plain | fused == {n for n in names if ".experts." not in n}
    assert {n for n in names if ".experts." in n} == {
        f"model.layers.{i}.mlp.experts.{w}" for i in range(1, TINY.num_hidden_layers) for w in ("w13", "w2")}
    assert all(not p.requires_grad for p in build_model(TINY, seed=None).parameters())


@pytest.mark.parametrize("world", [1, 2])
def test_checkpoint_round_trip(tmp_path, world):
    files = write_dummy_checkpoint(TINY, str(tmp_path), seed=4, dtype=torch.float32, max_shard_bytes=256 << 10)
    assert len(files) > 1 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    with open(tmp_path / "model.safetensors.index.json") as f:
        assert set(json.load(f)["weight_map"]) == set(expected_weights(TINY))
    want = shards(TINY, world, seed=4)
    for r in range(world):
        tp = TPGroup(r, world, None)
        model = build_model(TINY, tp, seed=None)
        assert load_checkpoint(model, TINY, tp, str(tmp_path), progress=False) == len(expected_weights(TINY))
        for name, t in params(model).items():
            assert torch.equal(t, want[r][name]), name


def test_bf16_checkpoint_casts_into_model_dtype(tmp_path):
    write_dummy_checkpoint(TINY, str(tmp_path), seed=0, dtype=torch.bfloat16)
    model = build_model(TINY, seed=None)
    load_checkpoint(model, TINY, TPGroup.single(), str(tmp_path), progress=False)
    got, want = params(model), params(build_model(TINY, seed=0))
    for name, t in got.items():
        assert t.dtype == want[name].dtype
        if name.endswith("e_score_correction_bias"):
            assert torch.equal(t, want[name])  # kept in fp32 on disk
        else:
            assert torch.equal(t, want[name].bfloat16().float()), name


def test_export_then_load_round_trip_tied(tmp_path):
    cfg = dataclasses.replace(TINY, tie_word_embeddings=True, q_lora_rank=None)
    src = build_model(cfg, seed=2)
    assert "lm_head.weight" not in dict(src.named_parameters())
    assert src.lm_head.shard_weight() is src.model.embed_tokens.weight
    save_checkpoint(cfg, str(tmp_path), export_state(src))
    dst = build_model(cfg, seed=None)
    load_checkpoint(dst, cfg, TPGroup.single(), str(tmp_path), progress=False)
    for name, t in params(dst).items():
        assert torch.equal(t, dict(src.named_parameters())[name]), name


def _broken_checkpoint(directory: str) -> dict:
    tensors = dict(checkpoint_tensors(TINY, seed=0))
    del tensors["model.layers.2.mlp.experts.5.up_proj.weight"]
    tensors["model.layers.1.mlp.not_a_weight"] = torch.zeros(3)
    tensors["model.layers.0.self_attn.kv_b_proj.weight"] = torch.zeros(7, 7)
    tensors[f"model.layers.{TINY.num_hidden_layers}.eh_proj.weight"] = torch.zeros(2, 2)  # MTP: ignored
    save_checkpoint(TINY, directory, tensors)
    return tensors


def test_checkpoint_errors_are_clear_and_write_nothing(tmp_path):
    _broken_checkpoint(str(tmp_path))
    model = build_model(TINY, seed=1)
    before = params(model)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(model, TINY, TPGroup.single(), str(tmp_path), progress=False)
    err = info.value
    assert err.missing == ["model.layers.2.mlp.experts.5.up_proj.weight"]
    assert err.unexpected == ["model.layers.1.mlp.not_a_weight"]
    assert len(err.mismatched) == 1 and "kv_b_proj" in err.mismatched[0] and "[7, 7]" in err.mismatched[0]
    text = str(err)
    for word in ("missing (1)", "unexpected (1)", "mis-shaped (1)", "experts.5.up_proj", "not_a_weight"):
        assert word in text
    for name, t in params(model).items():
        assert torch.equal(t, before[name]), f"{name} changed by a rejected checkpoint"


def test_no_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match="no model.safetensors.index.json"):
        load_checkpoint(build_model(TINY, seed=None), TINY, TPGroup.single(), str(tmp_path), progress=False)


def test_progress_goes_to_stderr(tmp_path, capfd):
    write_dummy_checkpoint(TINY, str(tmp_path), dtype=torch.float32)
    load_checkpoint(build_model(TINY, seed=None), TINY, TPGroup.single(), str(tmp_path), progress=True)
    out, err = capfd.readouterr()
    assert "loading weights" in err and "loading weights" not in out


def test_trainer_update_checks_then_slices(tmp_path):
    name = "model.layers.3.mlp.experts.7.down_proj.weight"  # [W, I], sharded along I
    new = torch.randn(expected_weights(TINY)[name])
    tp = TPGroup(1, 2, None)
    model = build_model(TINY, tp, seed=0)
    assert load_weights(model, TINY, tp, {name: new, "model.norm.weight": torch.full((TINY.hidden_size,), 2.0)}) == 2
    half = new.shape[1] // 2
    assert torch.equal(model.layers[3].mlp.experts.w2[7], new[:, half:])
    assert torch.equal(model.model.norm.weight, torch.full((TINY.hidden_size,), 2.0))

    problems = check_weights(TINY, {name: ((3, 3), torch.float32), "bogus.weight": ((1,), torch.float32),
                                    "model.norm.weight": ((TINY.hidden_size,), torch.int8)})
    assert len(problems) == 3
    assert any("bogus.weight" in p for p in problems) and any("int8" in p for p in problems)
    before = params(model)
    with pytest.raises(CheckpointError):
        load_weights(model, TINY, tp, [("model.norm.weight", torch.zeros(TINY.hidden_size)),
                                       (name, torch.zeros(3, 3))])
    assert all(torch.equal(t, before[n]) for n, t in params(model).items())
    assert check_weights(TINY, {n: (s, "BF16") for n, s in expected_weights(TINY).items()}) == []


def test_meta_build_materialise_and_buffers():
    tp = TPGroup.single()
    from service.model.model import CausalLM
    from service.weights import materialize_plain

    with torch.device("meta"):
        model = CausalLM(TINY, tp)
    assert all(p.is_meta for p in model.parameters())
    model = model.to(torch.bfloat16)
    # fp32-only tensors survive .to(dtype): the rope table and the router bias.
    assert model.model.rotary_emb.cos_sin.dtype == torch.float32
    assert model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert model.layers[1].mlp.gate.weight.dtype == torch.bfloat16
    materialize_plain(model, "cpu")
    table = model.model.rotary_emb.cos_sin
    want = table.clone()
    ptr = table.data_ptr()
    table.fill_(float("nan"))  # as a pool hands out fresh storage
    model.reset_buffers()
    assert model.model.rotary_emb.cos_sin.data_ptr() == ptr
    assert torch.equal(model.model.rotary_emb.cos_sin, want)
    assert want[0, 0].eq(1).all() and want[0, 1].eq(0).all()  # position 0: cos 1, sin 0


def test_dummy_checkpoint_config_loads_back(tmp_path):
    write_dummy_checkpoint(TINY, str(tmp_path), dtype=torch.float32)
    from service.config import ModelConfig

    cfg = ModelConfig.load(str(tmp_path))
    assert cfg.is_latent and cfg.moe_latent_size == TINY.moe_latent_size
    assert expected_weights(cfg) == expected_weights(TINY)
    assert os.path.exists(tmp_path / "config.json")
