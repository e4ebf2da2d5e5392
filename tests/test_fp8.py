"""FP8 block-scaled weights on CPU: DeepSeek-V3-format checkpoints (fp8 weights with
`_scale_inv` tensors) load at TP 1 and 2 and give the logits of the bf16 model quantized the
same way; `--quantization fp8` quantizes a bf16 checkpoint at load; a trainer's bf16 update is
quantized on the rank; bad scales are refused before anything changes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from _model_utils import build_model, full_logits, join_shards, params

from service import LLM, SamplingParams
from service.config import PRESETS, ConfigError
from service.parallel import TPGroup
from service.weights import (
    CheckpointError,
    check_weights,
    checkpoint_tensors,
    export_state,
    load_checkpoint,
    load_weights,
    save_checkpoint,
)
from service.weights import fp8 as fmt
from service.weights.specs import check_fp8_layout, fp8_pairs

pytestmark = pytest.mark.usefixtures("one_thread")

# Tiny's widths are not multiples of 128: 16x16 blocks keep every TP 2 shard on block bounds.
BLOCK = (16, 16)
QUANT = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK), "activation_scheme": "dynamic"}
TINY = dataclasses.replace(PRESETS["tiny"], num_hidden_layers=3)
FP8_TINY = dataclasses.replace(TINY, extra={**TINY.extra, "quantization_config": QUANT})
TOKENS = [5, 17, 300, 9, 44, 2, 811, 63]


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == fmt.FP8 else t


def fp8_checkpoint(directory, seed: int = 0) -> dict[str, torch.Tensor]:
    """The dummy bf16 model quantized as DeepSeek's conversion does: an FP8 checkpoint."""
    fp8_names = {w.hf_name for w, _ in fp8_pairs(FP8_TINY)}
    out = {}
    for name, t in checkpoint_tensors(TINY, seed):
        if name in fp8_names:
            out[name], out[name + fmt.SCALE_SUFFIX] = fmt.quantize(t.bfloat16(), BLOCK)
        else:
            out[name] = t.float() if name.endswith("e_score_correction_bias") else t.bfloat16()
    save_checkpoint(FP8_TINY, str(directory), out)
    return out


def fake_quantized_model(tensors: dict[str, torch.Tensor]):
    """The plain fp32 model holding the FP8 checkpoint's dequantized values."""
    plain = {n: fmt.dequantize(t, tensors[n + fmt.SCALE_SUFFIX], BLOCK) if t.dtype == fmt.FP8 else t.float()
             for n, t in tensors.items() if not n.endswith(fmt.SCALE_SUFFIX)}
    model = build_model(TINY, seed=None)
    load_weights(model, TINY, TPGroup.single(), plain)
    return model


def test_quantize_format():
    w = torch.randn(300, 200) * 0.05
    q, s = fmt.quantize(w, (128, 128))
    assert q.dtype == fmt.FP8 and q.shape == w.shape and s.shape == (3, 2) and s.dtype == torch.float32
    # scale = amax / 448 per block; dequantized values are within e4m3's half-ulp (2^-4 relative).
    assert torch.allclose(s[0, 0], w[:128, :128].abs().max() / 448)
    d = fmt.dequantize(q, s, (128, 128))
    assert ((d - w).abs() <= w.abs() * 2 ** -4 + s.max() * 2 ** -9).all()
    assert torch.equal(fmt.fake_quantize(d, (128, 128)), d)  # FP8 values quantize to themselves
    assert fmt.implied_block(q.shape, s.shape) == (128, 128)
    with pytest.raises(ConfigError, match="weight_block_size"):
        fmt.fp8_block(dataclasses.replace(TINY, extra={"quantization_config": {**QUANT, "weight_block_size": None}}))


def test_config_reads_quantization_config(tmp_path):
    FP8_TINY.save(str(tmp_path))
    from service.config import ModelConfig

    assert fmt.fp8_block(ModelConfig.load(str(tmp_path))) == BLOCK
    assert fmt.fp8_block(fmt.with_quantization(TINY, "fp8")) == (128, 128)
    # Tiny's fused q_a | kv_a rows put kv_a at row 64: 128-row blocks cannot hold it.
    with pytest.raises(ConfigError, match="kv_a_proj_with_mqa.*128-row block"):
        check_fp8_layout(fmt.with_quantization(TINY, "fp8"), 1)
    # 16-row blocks at TP 4: the experts' 32 / 4 = 8 rows per rank cut a block.
    with pytest.raises(ConfigError, match="TP 4 shard"):
        check_fp8_layout(FP8_TINY, 4)


def test_fp8_parameters_and_checkpoint_load_tp1(tmp_path):
    tensors = fp8_checkpoint(tmp_path)
    model = build_model(FP8_TINY, seed=None)
    load_checkpoint(model, FP8_TINY, TPGroup.single(), str(tmp_path), progress=False)
    p = dict(model.named_parameters())
    attn = "model.layers.1.self_attn"
    assert p[f"{attn}.q_b_proj.weight"].dtype == fmt.FP8
    assert p[f"{attn}.q_b_proj.weight_scale_inv"].shape == (192 // 16, 64 // 16)
    assert p["model.layers.1.mlp.experts.w13_scale_inv"].shape == (16, 64 // 16, 64 // 16)
    assert p[f"{attn}.kv_b_proj.weight"].dtype == torch.float32  # held dequantized (fp8.HELD_DEQUANTIZED)
    assert p["model.embed_tokens.weight"].dtype == p["model.layers.1.mlp.gate.weight"].dtype == torch.float32
    # Exactly the checkpoint's FP8 bytes and scales.
    name = f"{attn}.q_b_proj.weight"
    assert torch.equal(u8(p[name]), u8(tensors[name]))
    assert torch.equal(p[name + "_scale_inv"], tensors[name + "_scale_inv"])

    ours = full_logits(model, TOKENS)
    ref = full_logits(fake_quantized_model(tensors), TOKENS)
    assert (ours - ref).abs().max() < 1e-4
    plain = build_model(TINY, seed=0)  # the unquantized model: close, not equal
    err = (ours - full_logits(plain, TOKENS)).abs().max()
    assert err < 0.5 * full_logits(plain, TOKENS).abs().max()

    # Export writes the FP8 format back; loading it reproduces the model bit for bit.
    state = export_state(model)
    assert state[name].dtype == fmt.FP8 and name + "_scale_inv" in state
    again = build_model(FP8_TINY, seed=None)
    load_weights(again, FP8_TINY, TPGroup.single(), state)
    assert all(torch.equal(u8(t), u8(params(again)[n])) for n, t in params(model).items())


def test_fp8_checkpoint_shards_at_tp2(tmp_path):
    fp8_checkpoint(tmp_path)
    full = build_model(FP8_TINY, seed=None)
    load_checkpoint(full, FP8_TINY, TPGroup.single(), str(tmp_path), progress=False)
    full_p = dict(full.named_parameters())
    ranks = []
    for r in range(2):
        tp = TPGroup(r, 2, None)
        m = build_model(FP8_TINY, tp, seed=None)
        load_checkpoint(m, FP8_TINY, tp, str(tmp_path), progress=False)
        ranks.append(dict(m.named_parameters()))
    for name, t in full_p.items():
        if name.endswith("_scale_inv"):
            continue
        if t.dtype == fmt.FP8:  # each rank's blocks dequantize to its slice of the full tensor
            s = name + "_scale_inv"
            parts = [fmt.dequantize(rp[name], rp[s], BLOCK) for rp in ranks]
            whole = fmt.dequantize(t, full_p[s], BLOCK)
        else:
            parts, whole = [rp[name] for rp in ranks], t
        assert torch.equal(join_shards(name, parts, whole.shape), whole), name


def test_quantization_option_and_trainer_update(tmp_path):
    """A bf16 checkpoint served with quantization='fp8' through the public API; a trainer's bf16
    update is quantized on the rank; a bad scale leaves the served weights unchanged."""
    bf16 = {n: t.bfloat16() for n, t in checkpoint_tensors(TINY, 0)}
    cfg = dataclasses.replace(TINY, extra={**TINY.extra, "quantization_config": QUANT})
    save_checkpoint(TINY, str(tmp_path), bf16)  # plain config: the option makes it FP8
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": TOKENS}]
    with pytest.raises(ConfigError, match="128-row block"):  # default 128x128 blocks do not fit tiny
        LLM(str(tmp_path), distributed_executor_backend="uni", dtype="float32", quantization="fp8")
    # The same checkpoint with 16x16 blocks in its config.
    save_checkpoint(cfg, str(tmp_path), bf16)
    with LLM(str(tmp_path), distributed_executor_backend="uni", dtype="float32", quantization="fp8") as llm:
        model = llm.executor.rank0.model
        name = "model.layers.1.self_attn.q_b_proj.weight"
        p = dict(model.named_parameters())
        assert p[name].dtype == fmt.FP8
        before = llm.generate(prompts, greedy)[0].outputs[0].token_ids

        new = torch.randn(192, 64, dtype=torch.bfloat16) * 0.05
        assert llm.update_weights([(name, new)]) == 1
        q, s = fmt.quantize(new, BLOCK)
        assert torch.equal(u8(p[name]), u8(q)) and torch.equal(p[name + "_scale_inv"], s)

        # An FP8 update with a mis-shaped scale: refused, nothing written.
        snapshot = params(model)
        bad = [("model.layers.1.mlp.shared_experts.down_proj.weight", fmt.quantize(torch.randn(128, 32), BLOCK)[0]),
               ("model.layers.1.mlp.shared_experts.down_proj.weight_scale_inv", torch.ones(3, 3)),
               ("model.norm.weight", torch.zeros(128))]
        with pytest.raises(Exception, match="weight_scale_inv"):
            llm.update_weights(bad)
        assert all(torch.equal(u8(t), u8(snapshot[n])) for n, t in params(model).items())
        after = llm.generate(prompts, greedy)[0].outputs[0].token_ids
        assert len(after) == len(before) == 8


def test_update_checks_scales():
    name = "model.layers.1.self_attn.o_proj.weight"
    q, s = fmt.quantize(torch.randn(128, 128), BLOCK)
    assert check_weights(FP8_TINY, {name: (q.shape, q.dtype), name + "_scale_inv": (s.shape, s.dtype)}) == []
    assert check_weights(FP8_TINY, {name: (q.shape, torch.bfloat16)}) == []  # quantized on the rank
    problems = check_weights(FP8_TINY, {name: (q.shape, q.dtype)})  # FP8 without its scale
    assert problems and "scale" in " ".join(problems)
    problems = check_weights(FP8_TINY, {name + "_scale_inv": (s.shape, s.dtype)})  # scale alone
    assert problems and "without its FP8 weight" in " ".join(problems)
    assert check_weights(TINY, {name: (q.shape, q.dtype)})  # FP8 into a plain model
    model = build_model(FP8_TINY, seed=0)
    before = params(model)
    with pytest.raises(CheckpointError, match="mis-shaped"):
        load_weights(model, FP8_TINY, TPGroup.single(), {name: q, name + "_scale_inv": torch.ones(8, 4)})
    assert all(torch.equal(u8(t), u8(before[n])) for n, t in params(model).items())


def test_sleep_levels_keep_fp8_tokens(tmp_path):
    """Pool-held FP8 weights and scales: level 1 offloads and restores both; level 2 discards both
    and a trainer's fp32 update (quantized on the rank) brings the same tokens back."""
    save_checkpoint(FP8_TINY, str(tmp_path), {n: t.bfloat16() for n, t in checkpoint_tensors(TINY, 0)})
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": TOKENS}, {"prompt_token_ids": [44, 2, 811]}]
    with LLM(str(tmp_path), distributed_executor_backend="uni", dtype="float32", enable_sleep_mode=True) as llm:
        assert dict(llm.executor.rank0.model.named_parameters())["model.layers.1.mlp.experts.w13"].dtype == fmt.FP8
        base = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        llm.sleep(level=1)
        llm.wake_up()
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == base
        llm.sleep(level=2)
        llm.wake_up()
        llm.update_weights([(n, t.bfloat16()) for n, t in checkpoint_tensors(TINY, 0)])
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == base


def test_kimi_k3_fp8_matches_its_dequantized_values():
    """k3-tiny (KDA, latent MoE, attention residuals): KDA's q/k/v/o/g projections are FP8, its
    small gate tensors and the attention residuals' queries stay in the model dtype; the logits
    are those of the plain model holding the dequantized values."""
    k3 = PRESETS["k3-tiny"]
    cfg = dataclasses.replace(k3, extra={**k3.extra, "quantization_config": QUANT})
    model = build_model(cfg, seed=0)
    p = dict(model.named_parameters())
    assert p["model.layers.0.self_attn.q_proj.weight"].dtype == fmt.FP8
    assert p["model.layers.0.self_attn.f_a_proj.weight"].dtype == torch.float32
    assert p["model.layers.0.mlp_res_proj.weight"].dtype == torch.float32
    state = export_state(model)
    plain = {n: fmt.dequantize(t, state[n + fmt.SCALE_SUFFIX]) if t.dtype == fmt.FP8 else t
             for n, t in state.items() if not n.endswith(fmt.SCALE_SUFFIX)}
    ref = build_model(k3, seed=None)
    load_weights(ref, k3, TPGroup.single(), plain)
    assert (full_logits(model, TOKENS) - full_logits(ref, TOKENS)).abs().max() < 1e-4


def test_fp8_engine_tp2_gives_tp1_tokens(tmp_path):
    """The FP8 checkpoint served at TP 2 (one process per rank, each reading its blocks)
    generates TP 1's greedy tokens."""
    fp8_checkpoint(tmp_path)
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = [{"prompt_token_ids": TOKENS}, {"prompt_token_ids": [44, 2, 811]}, {"prompt_token_ids": [7, 8, 9]}]
    out = []
    for tp, backend in ((1, "uni"), (2, "mp")):
        with LLM(str(tmp_path), tensor_parallel_size=tp, distributed_executor_backend=backend, dtype="float32") as llm:
            out.append([o.outputs[0].token_ids for o in llm.generate(prompts, greedy)])
    assert out[0] == out[1]
