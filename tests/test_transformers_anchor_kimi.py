"""External anchor: transformers 5.19's KimiLinearForCausalLM and our model agree, both ways.

(a) a random transformers model (KDA and MLA layers, low-rank KDA output gate, MoE with grouped
    routing, rms_norm_eps 1e-6), save_pretrained, loads in ours: prompt logits agree and our
    engine (`service.LLM`, TP 1 in process and TP 2 over spawned ranks) gives transformers'
    greedy tokens, 16 prompts x 32 tokens, fp32;
(b) our model with the latent MoE off, saved with `save_checkpoint(export_state(...))`, loads in
    transformers with the same tokens.

One reading differs on purpose: the KDA output norm's eps. transformers builds it with
rms_norm_eps (modeling_kimi_linear.py:603), vLLM with FusedRMSNormGated's default 1e-5 (no eps
passed: models/kimi_k3/amd/kda.py:268, kimi_gdn_linear_attn.py:304), and so do we. Random KDA
outputs are small (mean square ~1e-5, some rows ~1e-8), where that eps decides the output, so
the transformers reference runs with its KDA `o_norm` eps set to vLLM's 1e-5; everything else
is transformers as it is. With its own eps the logits differ by O(1) (printed by the logits test).

What transformers writes is not quite a vLLM/Kimi checkpoint, and the tests say so where it
matters: its save renames every `.mlp.` to `.block_sparse_moe.` (conversion_mapping.py
"kimi_linear", applied in reverse), the dense layer's MLP included, and its config.json has no
`mla_use_nope` (its KimiLinear is always NoPE; vLLM asserts `mla_use_nope`; we read a missing key
as NoPE). Its `A_log` is
[1, 1, H, 1] on disk and it refuses our [H]. The greedy runs use the checkpoint as a Kimi one is
written (dense MLP under `mlp.`, `mla_use_nope: true`, A_log as transformers wants it; our
loader takes both A_log layouts).

transformers' references: logits from full forwards without a cache; tokens from its own
cached greedy loop (recurrent KDA state, MLA cache), prompts of equal length batched together.
"""

from __future__ import annotations

import glob
import json
import os
import random
import shutil

import pytest
import torch
from _model_utils import assert_same_greedy, build_model, full_logits
from safetensors.torch import load_file, save_file

from service import LLM, SamplingParams
from service.config import PRESETS, ConfigError, ModelConfig
from service.parallel import TPGroup
from service.weights import CheckpointError, export_state, load_checkpoint, save_checkpoint

pytestmark = pytest.mark.usefixtures("one_thread")

transformers = pytest.importorskip("transformers")

STEPS = 32
LENGTHS = (4, 11, 23, 38)  # four prompts of each length: 16, batched by length in transformers
LOGIT_TOLERANCE = 1e-4

HF_CONFIG = dict(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=16, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=4, num_local_experts=16, num_experts_per_tok=4, n_group=4,
    topk_group=2, n_shared_experts=1, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=32,
    qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, rms_norm_eps=1e-6, first_k_dense_replace=1,
    # Larger than the 0.02 default so that greedy argmaxes have clear margins.
    initializer_range=0.1, tie_word_embeddings=False, pad_token_id=None, bos_token_id=0, eos_token_id=1,
    linear_attn_config={"kda_layers": [1, 2, 4], "full_attn_layers": [3], "num_heads": 4, "head_dim": 16,
                        "short_conv_kernel_size": 4},
)
VLLM_O_NORM_EPS = 1e-5  # vLLM's KDA o_norm eps (FusedRMSNormGated's default)
DENSE_LAYERS = [0]  # first_k_dense_replace=1
DENSE_MLP_TENSORS = ("down_proj.weight", "gate_proj.weight", "up_proj.weight")


def make_prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(n)] for n in LENGTHS for _ in range(4)]


# ---- transformers as the reference ----------------------------------------------------------------

def kda_o_norms(hf) -> list:
    return [layer.self_attn.o_norm for layer in hf.model.layers if hasattr(layer.self_attn, "o_norm")]


def with_vllm_o_norm_eps(hf):
    """transformers' model with its KDA output norms at vLLM's eps (see the module docstring)."""
    norms = kda_o_norms(hf)
    assert norms and all(n.variance_epsilon == hf.config.rms_norm_eps for n in norms)
    for n in norms:
        n.variance_epsilon = VLLM_O_NORM_EPS
    return hf


@torch.inference_mode()
def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens]), use_cache=False).logits[0].float()


@torch.inference_mode()
def hf_greedy(hf, prompts: list[list[int]], steps: int) -> tuple[list[list[int]], list[list[float]]]:
    """Cached greedy decoding, prompts of one length per batch. Returns tokens and top-2 margins."""
    tokens: dict[int, list[int]] = {}
    margins: dict[int, list[float]] = {}
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    for idx in by_len.values():
        ids = torch.tensor([prompts[i] for i in idx])
        out = hf(ids, use_cache=True)
        new, gaps = [], []
        for _ in range(steps):
            last = out.logits[:, -1].float()
            top = last.topk(2, dim=-1).values
            gaps.append((top[:, 0] - top[:, 1]).tolist())
            nxt = last.argmax(-1)
            new.append(nxt.tolist())
            out = hf(nxt[:, None], past_key_values=out.past_key_values, use_cache=True)
        for row, i in enumerate(idx):
            tokens[i] = [step[row] for step in new]
            margins[i] = [step[row] for step in gaps]
    return [tokens[i] for i in range(len(prompts))], [margins[i] for i in range(len(prompts))]


def assert_not_degenerate(tokens: list[list[int]]) -> None:
    assert len({t for seq in tokens for t in seq}) >= 32, f"degenerate greedy output: {tokens}"
    assert len({tuple(s) for s in tokens}) == len(tokens), "two prompts generated the same tokens"


def ours_greedy(directory: str, prompts: list[list[int]], tp: int) -> list[list[int]]:
    backend = "uni" if tp == 1 else "mp"
    with LLM(model=directory, tensor_parallel_size=tp, dtype="float32",
             distributed_executor_backend=backend) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True))
    return [list(o.outputs[0].token_ids) for o in outs]


def max_logit_diff(hf, ours, prompts: list[list[int]]) -> float:
    return max((hf_logits(hf, p) - full_logits(ours, p)).abs().max().item() for p in prompts)


def rewrite_checkpoint(src: str, dst: str, rename=None, reshape=None,
                       config_updates: dict | None = None) -> None:
    """Copy a checkpoint, renaming tensors (name -> name) and reshaping them (name -> shape or None)."""
    shutil.copytree(src, dst)
    for path in glob.glob(os.path.join(dst, "*.safetensors")):
        state = load_file(path)
        out = {}
        for name, t in state.items():
            shape = reshape(name, t) if reshape else None
            out[rename(name) if rename else name] = t.reshape(shape) if shape is not None else t
        save_file(out, path, metadata={"format": "pt"})
    index = os.path.join(dst, "model.safetensors.index.json")
    if rename and os.path.exists(index):
        with open(index) as f:
            idx = json.load(f)
        idx["weight_map"] = {rename(n): fn for n, fn in idx["weight_map"].items()}
        with open(index, "w") as f:
            json.dump(idx, f)
    if config_updates:
        with open(os.path.join(dst, "config.json")) as f:
            cfg = json.load(f)
        cfg.update(config_updates)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)


def dense_mlp_to_kimi_name(name: str) -> str:
    """transformers' save spelling of a dense layer's MLP -> vLLM's / a Kimi checkpoint's."""
    for i in DENSE_LAYERS:
        prefix = f"model.layers.{i}.block_sparse_moe."
        if name.startswith(prefix) and name.removeprefix(prefix) in DENSE_MLP_TENSORS:
            return f"model.layers.{i}.mlp." + name[len(prefix):]
    return name


# ---- (a) transformers -> ours ------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_side(tmp_path_factory):
    """(transformers model, its save_pretrained dir, the same as a Kimi checkpoint is written)."""
    torch.manual_seed(7)
    hf = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**HF_CONFIG)).float().eval()
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, t in list(hf.named_parameters()) + list(hf.named_buffers()):
            if name.endswith("e_score_correction_bias"):  # transformers leaves it at zero
                t.copy_((torch.rand(t.shape, generator=g) - 0.5) * 0.2)
            elif "norm" in name and t.dim() == 1:  # and every norm at one
                t.copy_(1.0 + 0.2 * torch.randn(t.shape, generator=g))
    raw = str(tmp_path_factory.mktemp("hf_raw"))
    hf.save_pretrained(raw)
    with_vllm_o_norm_eps(hf)
    kimi = str(tmp_path_factory.mktemp("hf_kimi") / "ckpt")
    rewrite_checkpoint(raw, kimi, rename=dense_mlp_to_kimi_name, config_updates={"mla_use_nope": True})
    return hf, raw, kimi


def test_transformers_save_differs_from_a_kimi_checkpoint_only_in_the_dense_mlp_names(hf_side):
    """Every KDA/MLA/MoE name and shape of transformers' save is ours (A_log [1, 1, H, 1] and the
    [C, 1, K] convs included); only the dense layer's MLP is spelled `block_sparse_moe.*_proj`,
    which vLLM's loader does not know either (it names that module `mlp`)."""
    _, raw, _ = hf_side
    cfg = ModelConfig.load(raw)
    model = build_model(cfg, seed=None)
    try:
        load_checkpoint(model, cfg, TPGroup.single(), raw, progress=False)
        return  # the loader learnt transformers' spelling: fine too
    except CheckpointError as err:
        assert err.unexpected == [f"model.layers.{i}.block_sparse_moe.{t}" for i in DENSE_LAYERS
                                  for t in DENSE_MLP_TENSORS]
        assert err.missing == [f"model.layers.{i}.mlp.{t}" for i in DENSE_LAYERS for t in DENSE_MLP_TENSORS]
        assert err.mismatched == [] and err.other == []


def test_config_reads_as_transformers_means_it(hf_side):
    _, _, kimi = hf_side
    cfg = ModelConfig.load(kimi)
    assert cfg.is_kimi and not cfg.is_latent and cfg.hidden_act == "silu"
    assert cfg.kda_layers == [0, 1, 3] and cfg.mla_layers == [2] and not cfg.kda_full_rank_gate
    assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group) == (16, 4, 4, 2)
    assert (cfg.n_shared_experts, cfg.first_k_dense_replace, cfg.routed_scaling_factor) == (1, 1, 2.5)
    assert cfg.scoring_func == "sigmoid" and cfg.norm_topk_prob and cfg.rms_norm_eps == 1e-6
    assert cfg.latent_norm_eps == 1e-6  # transformers' q_a/kv_a_layernorm: KimiLinearRMSNorm's fixed 1e-6
    assert cfg.attn_res_block_size is None and not cfg.mla_use_output_gate


def test_config_without_mla_use_nope_is_nope_or_refused(hf_side):
    hf, raw, kimi = hf_side
    cfg = ModelConfig.load(raw)
    try:
        ours = build_model(cfg, seed=None)
    except ConfigError:
        return  # refused, as vLLM does
    load_checkpoint(ours, cfg, TPGroup.single(), kimi, progress=False)
    assert max_logit_diff(hf, ours, make_prompts(cfg.vocab_size, seed=1)[:4]) < LOGIT_TOLERANCE


@pytest.fixture(scope="module")
def hf_reference(hf_side):
    hf, _, _ = hf_side
    prompts = make_prompts(HF_CONFIG["vocab_size"], seed=1)
    tokens, margins = hf_greedy(hf, prompts, STEPS)
    assert_not_degenerate(tokens)
    return prompts, tokens, margins


def test_transformers_checkpoint_logits_in_ours(hf_side, hf_reference):
    hf, _, kimi = hf_side
    prompts, tokens, _ = hf_reference
    cfg = ModelConfig.load(kimi)
    ours = build_model(cfg, seed=None)
    load_checkpoint(ours, cfg, TPGroup.single(), kimi, progress=False)
    # Prompts, and prompts with their greedy continuations (up to 69 tokens: past transformers'
    # 64-token KDA chunk).
    checked = prompts[::4] + [p + t[:-1] for p, t in zip(prompts[3::4], tokens[3::4])]
    diff = max_logit_diff(hf, ours, checked)
    norms = kda_o_norms(hf)
    for n in norms:
        n.variance_epsilon = hf.config.rms_norm_eps
    try:
        own_eps = max_logit_diff(hf, ours, checked)
    finally:
        for n in norms:
            n.variance_epsilon = VLLM_O_NORM_EPS
    print(f"transformers -> ours: max |logit diff| {diff:.2e} (with transformers' own o_norm eps "
          f"{hf.config.rms_norm_eps}: {own_eps:.2e})")
    assert diff < LOGIT_TOLERANCE, f"logits differ by {diff}"


@pytest.mark.parametrize("tp", [1, 2])
def test_transformers_checkpoint_greedy_in_ours(hf_side, hf_reference, tp):
    _, _, kimi = hf_side
    prompts, ref, margins = hf_reference
    ours = ours_greedy(kimi, prompts, tp)
    full = assert_same_greedy(ref, margins, ours)
    print(f"transformers -> ours TP {tp}: {full}/{len(prompts)} sequences identical")
    assert full >= len(prompts) - 1


# ---- (b) ours -> transformers ------------------------------------------------------------------

# k3-tiny without what transformers' KimiLinear lacks: no latent MoE, attention residuals, MLA
# output gate, SiTU or full-rank KDA gate. KDA layers 1-3, MLA layer 4, grouped sigmoid routing.
OURS = ModelConfig.from_dict({
    **PRESETS["k3-tiny"].to_dict(), "routed_expert_hidden_size": None, "attn_res_block_size": None,
    "mla_use_output_gate": False, "hidden_act": "silu", "activation_situ_beta": None,
    "activation_situ_linear_beta": None, "num_nextn_predict_layers": 0, "rms_norm_eps": 1e-6,
    "initializer_range": 0.1, "pad_token_id": None,  # transformers' default pad id is beyond a tiny vocab
    "linear_attn_config": {**PRESETS["k3-tiny"].linear_attn_config, "use_full_rank_gate": False}})


@pytest.fixture(scope="module")
def ours_side(tmp_path_factory):
    model = build_model(OURS, seed=3)
    ours_dir = str(tmp_path_factory.mktemp("ours") / "ckpt")
    save_checkpoint(OURS, ours_dir, export_state(model))
    return model, ours_dir


def test_our_checkpoint_in_transformers_differs_only_in_a_log_shape(ours_side):
    """transformers keeps A_log as [1, 1, H, 1] and will not reshape ours ([H], vLLM's current
    layout); nothing else is missing, unexpected or mis-shaped."""
    _, ours_dir = ours_side
    _, info = transformers.KimiLinearForCausalLM.from_pretrained(
        ours_dir, dtype=torch.float32, output_loading_info=True, ignore_mismatched_sizes=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    mismatched = sorted(name for name, *_ in info["mismatched_keys"])
    heads = OURS.kda_num_heads
    assert mismatched == [f"model.layers.{i}.self_attn.forget_gate.A_log" for i in OURS.kda_layers]
    assert all(tuple(shapes[0]) == (heads,) and tuple(shapes[1]) == (1, 1, heads, 1)
               for _, *shapes in info["mismatched_keys"])


def test_our_checkpoint_greedy_in_transformers(ours_side, tmp_path):
    model, ours_dir = ours_side
    hf_dir = str(tmp_path / "for_transformers")
    rewrite_checkpoint(ours_dir, hf_dir,
                       reshape=lambda name, t: (1, 1, t.numel(), 1) if name.endswith("A_log") else None)
    hf, info = transformers.KimiLinearForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                                 output_loading_info=True)
    with_vllm_o_norm_eps(hf.eval())
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    prompts = make_prompts(OURS.vocab_size, seed=2)
    diff = max_logit_diff(hf, model, prompts[::4])
    print(f"ours -> transformers: max |logit diff| {diff:.2e}")
    assert diff < LOGIT_TOLERANCE, f"logits differ by {diff}"
    ref, margins = hf_greedy(hf, prompts, STEPS)
    assert_not_degenerate(ref)
    ours = ours_greedy(hf_dir, prompts, 1)  # our loader reads the [1, 1, H, 1] A_log too
    full = assert_same_greedy(ref, margins, ours)
    print(f"ours -> transformers: {full}/{len(prompts)} sequences identical")
    assert full >= len(prompts) - 1
