"""The KDA layer (service/model/kda.py) on CPU, fp32.

Decodes through the state rows against one chunked prefill (and prefills split across steps,
and mixed batches that leave other rows alone); the whole layer against transformers'
KimiLinearDeltaAttention (Kimi-Linear's low-rank output gate) and against an independent
float64 token-by-token recurrence (Kimi-K3's full-rank gate with a gate lower bound); TP 2
against TP 1 on the same logical weights.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F
from _model_utils import run_tp

from service.config import PRESETS, ConfigError, ModelConfig
from service.engine.plan import SeqChunk
from service.model.attn_metadata import AttnMetadata
from service.model.kda import KDAState, KimiDeltaAttention, chunked_kda, kda_state_shapes
from service.parallel import TPGroup

pytestmark = pytest.mark.usefixtures("one_thread")

K3 = PRESETS["k3-tiny"]  # full-rank output gate, no lower bound
LINEAR = dataclasses.replace(K3, rms_norm_eps=1e-5, linear_attn_config={
    **K3.linear_attn_config, "use_full_rank_gate": False})  # Kimi-Linear's low-rank g_a/g_b
K3_BOUNDED = dataclasses.replace(K3, linear_attn_config={**K3.linear_attn_config, "gate_lower_bound": -5.0})
ROWS = 8
REPLICATED = {"f_a_proj.weight", "g_a_proj.weight", "o_norm.weight"}


# ---- weights, metadata, state -----------------------------------------------------------------

def logical_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """Full float64 tensors under the layer's parameter names. Decays exp(g) spread over about
    [0.2, 1): the state carries information across a 150-token sequence, and every chunk
    boundary matters."""
    g = torch.Generator().manual_seed(seed)
    h, heads, d, width = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
    proj = heads * d

    def lin(out: int, inp: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(out, inp, generator=g, dtype=torch.float64) * scale / inp ** 0.5

    dt = (torch.rand(proj, generator=g, dtype=torch.float64) * (torch.tensor(0.1).log() - torch.tensor(1e-3).log())
          + torch.tensor(1e-3).log()).exp()
    w = {f"{x}_proj.weight": lin(proj, h) for x in "qkv"}
    w |= {f"{x}_conv1d.weight": 0.6 * torch.randn(proj, 1, width, generator=g, dtype=torch.float64) for x in "qkv"}
    w |= {
        "f_a_proj.weight": lin(d, h),
        "f_b_proj.weight": lin(proj, d, 0.5),
        "dt_bias": dt + torch.log(-torch.expm1(-dt)),  # inverse softplus of dt
        "A_log": (1 + 3 * torch.rand(heads, generator=g, dtype=torch.float64)).log(),
        "b_proj.weight": lin(heads, h),
        "o_norm.weight": 1 + 0.2 * torch.randn(d, generator=g, dtype=torch.float64),
        "o_proj.weight": lin(h, proj),
    }
    if cfg.kda_full_rank_gate:
        w["g_proj.weight"] = lin(proj, h)
    else:
        w["g_a_proj.weight"] = lin(d, h)
        w["g_b_proj.weight"] = lin(proj, d)
    return w


def shard(name: str, t: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    if name in REPLICATED:
        return t
    dim = 1 if name == "o_proj.weight" else 0
    size = t.shape[dim] // tp.world_size
    return t.narrow(dim, tp.rank * size, size)


def build_layer(cfg: ModelConfig, tp: TPGroup | None = None, seed: int = 0) -> KimiDeltaAttention:
    tp = tp or TPGroup.single()
    layer = KimiDeltaAttention(cfg, tp, 0, torch.float32)
    weights = logical_weights(cfg, seed)
    params = dict(layer.named_parameters())
    assert set(params) == set(weights)
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(shard(name, weights[name], tp))
    return layer.eval()


def meta_for(chunks: list[tuple[int, int, int]]) -> AttnMetadata:
    """chunks: (length, start position, state slot)."""
    return AttnMetadata.build([SeqChunk(i, [0] * n, start, [], state_slot=slot)
                               for i, (n, start, slot) in enumerate(chunks)], 16, "cpu")


def nan_state(cfg: ModelConfig, tp_size: int = 1) -> KDAState:
    """Unwritten rows are NaN, so a row read before it is written shows up in the outputs."""
    shapes = kda_state_shapes(cfg, tp_size)
    return KDAState(**{k: torch.full((ROWS, *shape), float("nan"), dtype=dt or torch.float32)
                       for k, (shape, dt) in shapes.items()})


def hidden(n: int, cfg: ModelConfig, seed: int = 1) -> torch.Tensor:
    return torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(seed))


def run(layer: KimiDeltaAttention, x: torch.Tensor, chunks: list[tuple[int, int, int]],
        state: KDAState | None) -> torch.Tensor:
    with torch.inference_mode():
        return layer(x, meta_for(chunks), state)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equal, NaNs included (fp32)."""
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str, tol: float = 2e-5) -> None:
    """Relative to the reference's largest entry: fp32 rounding over up to 150 steps."""
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} vs {tuple(ref.shape)}"
    assert not ours.isnan().any(), f"{what}: NaN in the output (a row read before it was written?)"
    err = max_diff(ours, ref) / max(ref.abs().max().item(), 1e-6)
    assert err < tol, f"{what}: relative max abs diff {err:.2e}"


@pytest.fixture(scope="module")
def k3_layer():
    return build_layer(K3)


# ---- interface ----------------------------------------------------------------------------------

def test_parameters_state_shapes_and_fp32_tensors():
    cfg = LINEAR
    h, heads, d, w = cfg.hidden_size, cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size
    with torch.device("meta"):
        layer = KimiDeltaAttention(cfg, TPGroup(1, 2), 0, torch.float32).to(torch.bfloat16)
    shapes = {n: tuple(p.shape) for n, p in layer.named_parameters()}
    half = heads * d // 2
    assert shapes == {
        "q_proj.weight": (half, h), "k_proj.weight": (half, h), "v_proj.weight": (half, h),
        "q_conv1d.weight": (half, 1, w), "k_conv1d.weight": (half, 1, w), "v_conv1d.weight": (half, 1, w),
        "f_a_proj.weight": (d, h), "f_b_proj.weight": (half, d), "dt_bias": (half,), "A_log": (heads // 2,),
        "b_proj.weight": (heads // 2, h), "g_a_proj.weight": (d, h), "g_b_proj.weight": (half, d),
        "o_norm.weight": (d,), "o_proj.weight": (h, half)}
    assert layer.dt_bias.dtype == layer.A_log.dtype == torch.float32
    assert layer.q_proj.weight.dtype == torch.bfloat16
    assert "g_proj.weight" in dict(KimiDeltaAttention(K3, TPGroup.single(), 0, torch.float32).named_parameters())
    assert kda_state_shapes(cfg, 2) == {"conv": ((3 * half, w - 1), torch.float32), "recurrent": ((heads // 2, d, d),
                                                                                        torch.float32)}
    with pytest.raises(ConfigError):
        kda_state_shapes(cfg, 3)


def test_chunked_form_matches_the_recurrence():
    """The WY/UT chunked form alone, from a non-zero state, against the plain float64 loop."""
    g = torch.Generator().manual_seed(3)
    n, heads, d = 150, 2, 8
    q = F.normalize(torch.randn(n, heads, d, generator=g, dtype=torch.float64), dim=-1) * d ** -0.5
    k = F.normalize(torch.randn(n, heads, d, generator=g, dtype=torch.float64), dim=-1)
    v = torch.randn(n, heads, d, generator=g, dtype=torch.float64)
    decay = -3 * torch.rand(n, heads, d, generator=g, dtype=torch.float64)
    beta = torch.rand(n, heads, generator=g, dtype=torch.float64)
    s0 = torch.randn(heads, d, d, generator=g, dtype=torch.float64)
    out, s1 = chunked_kda(q, k, v, decay, beta, s0)
    s, ref = s0.clone(), []
    for t in range(n):
        s = s * decay[t].exp()[..., None]
        u = beta[t][:, None] * (v[t] - torch.einsum("hkv,hk->hv", s, k[t]))
        s = s + k[t][..., None] * u[:, None, :]
        ref.append(torch.einsum("hkv,hk->hv", s, q[t]))
    assert max_diff(out, torch.stack(ref)) < 1e-12
    assert max_diff(s1, s) < 1e-12


# ---- decode = prefill ---------------------------------------------------------------------------

@pytest.mark.parametrize("length", [1, 5, 63, 64, 65, 150])
def test_token_by_token_decode_matches_one_prefill(k3_layer, length):
    x = hidden(length, K3)
    one = nan_state(K3)
    prefill = run(k3_layer, x, [(length, 0, 3)], one)
    assert_close(prefill, run(k3_layer, x, [(length, 0, 0)], None), "prefill with state vs cache-less")
    steps = nan_state(K3)
    decoded = torch.cat([run(k3_layer, x[t:t + 1], [(1, t, 3)], steps) for t in range(length)])
    assert_close(decoded, prefill, f"decode vs prefill, length {length}")
    assert_close(steps.recurrent[3], one.recurrent[3], "final recurrent state")
    assert_close(steps.conv[3], one.conv[3], "conv history", tol=1e-6)  # row vs batch matmul rounding
    for s in (steps, one):  # only row 3 was ever written
        assert s.recurrent[torch.arange(ROWS) != 3].isnan().all() and s.conv[torch.arange(ROWS) != 3].isnan().all()


def test_conv_history_is_the_last_inputs(k3_layer):
    """The conv row holds the last conv_size-1 pre-conv q|k|v inputs, with the zero history in
    front while the sequence is shorter than that."""
    x = hidden(2, K3, seed=5)
    state = nan_state(K3)
    run(k3_layer, x, [(2, 0, 1)], state)
    with torch.no_grad():
        inputs = torch.cat([k3_layer.q_proj(x), k3_layer.k_proj(x), k3_layer.v_proj(x)], dim=-1).t()
    expected = torch.cat([torch.zeros(inputs.shape[0], K3.kda_conv_size - 3), inputs], dim=1)
    assert torch.equal(state.conv[1], expected)


@pytest.mark.parametrize("split", [(70, 80), (2, 1, 70, 77)])
def test_prefill_split_across_steps(k3_layer, split):
    """Continuation from the row, including chunks shorter than the conv history."""
    x = hidden(sum(split), K3, seed=2)
    whole_state = nan_state(K3)
    whole = run(k3_layer, x, [(len(x), 0, 5)], whole_state)
    state, outs, start = nan_state(K3), [], 0
    for n in split:
        outs.append(run(k3_layer, x[start:start + n], [(n, start, 5)], state))
        start += n
    assert_close(torch.cat(outs), whole, f"prefill in steps {split}")
    assert_close(state.recurrent[5], whole_state.recurrent[5], "final recurrent state")
    assert_close(state.conv[5], whole_state.conv[5], "conv history", tol=1e-6)


def test_mixed_batch_of_decodes_and_prefills(k3_layer):
    """One step with decodes (one of them a one-token prompt at position 0 on a NaN row),
    a prefill continuation and a fresh prefill, on scattered rows; every chunk gets what it gets
    alone, and rows outside the batch keep their bits."""
    seqs = {name: hidden(n, K3, seed=10 + i) for i, (name, n) in enumerate(
        [("cont", 51), ("decode", 12), ("fresh", 13), ("one", 2), ("decode2", 5)])}
    slot = {"cont": 1, "decode": 2, "fresh": 4, "one": 5, "decode2": 6}
    state = nan_state(K3)
    state.recurrent[3] = torch.randn(state.recurrent[3].shape)  # another sequence's row
    state.conv[3] = torch.randn(state.conv[3].shape)
    # Earlier steps: the prompts of the continuing sequences.
    run(k3_layer, seqs["cont"][:30], [(30, 0, slot["cont"])], state)
    run(k3_layer, torch.cat([seqs["decode"][:10], seqs["decode2"][:3]]),
        [(10, 0, slot["decode"]), (3, 0, slot["decode2"])], state)
    before = state.recurrent.clone(), state.conv.clone()

    mixed = [("decode", 10, 1), ("cont", 30, 20), ("one", 0, 1), ("fresh", 0, 12), ("decode2", 3, 1)]
    decodes = [("fresh", 12, 1), ("cont", 50, 1), ("decode2", 4, 1), ("one", 1, 1), ("decode", 11, 1)]
    for what, order in (("mixed batch", mixed), ("then all-decode batch", decodes)):
        x = torch.cat([seqs[name][start:start + n] for name, start, n in order])
        out = run(k3_layer, x, [(n, start, slot[name]) for name, start, n in order], state)
        at = 0
        for name, start, n in order:
            alone = run(k3_layer, seqs[name][:start + n], [(start + n, 0, 0)], None)[start:]
            assert_close(out[at:at + n], alone, f"{name} in the {what}")
            at += n
        for row in (0, 3, 7):
            assert same_bits(state.recurrent[row], before[0][row]) and same_bits(state.conv[row], before[1][row])
    assert not state.recurrent[list(slot.values())].isnan().any()


def test_cache_less_chunks_must_start_at_zero(k3_layer):
    with pytest.raises(ValueError, match="position 0"):
        run(k3_layer, hidden(3, K3), [(3, 4, 0)], None)


# ---- against transformers and a float64 reference ----------------------------------------------

def test_matches_transformers_kimi_linear():
    from transformers import KimiLinearConfig
    from transformers.models.kimi_linear.modeling_kimi_linear import KimiLinearDeltaAttention

    cfg = LINEAR
    lac = cfg.linear_attn_config
    hf_cfg = KimiLinearConfig(hidden_size=cfg.hidden_size, num_hidden_layers=1, hidden_act="silu",
                              rms_norm_eps=cfg.rms_norm_eps,
                              linear_attn_config={"kda_layers": [1], "full_attn_layers": [],
                                                  "num_heads": lac["num_heads"], "head_dim": lac["head_dim"],
                                                  "short_conv_kernel_size": lac["short_conv_kernel_size"]})
    theirs = KimiLinearDeltaAttention(hf_cfg, layer_idx=0).eval()
    w = {k: v.float() for k, v in logical_weights(cfg, seed=4).items()}
    heads = cfg.kda_num_heads
    theirs.load_state_dict({
        "q_proj.weight": w["q_proj.weight"], "k_proj.weight": w["k_proj.weight"], "v_proj.weight": w["v_proj.weight"],
        "conv1d.weight": torch.cat([w["q_conv1d.weight"], w["k_conv1d.weight"], w["v_conv1d.weight"]]),
        "forget_gate.f_a_proj.weight": w["f_a_proj.weight"], "forget_gate.f_b_proj.weight": w["f_b_proj.weight"],
        "forget_gate.dt_bias": w["dt_bias"], "forget_gate.A_log": w["A_log"].view(1, 1, heads, 1),
        "b_proj.weight": w["b_proj.weight"], "g_a_proj.weight": w["g_a_proj.weight"],
        "g_b_proj.weight": w["g_b_proj.weight"], "o_norm.weight": w["o_norm.weight"],
        "o_proj.weight": w["o_proj.weight"]})
    ours = build_layer(cfg, seed=4)
    x = hidden(100, cfg, seed=6)  # two chunks of 64, the second partial
    with torch.inference_mode():
        ref = theirs(x.unsqueeze(0))[0]
    mine = run(ours, x, [(100, 0, 0)], None)
    diff = max_diff(mine, ref)
    assert diff < 2e-5 * ref.abs().max().item(), f"max abs diff {diff:.2e} against transformers (max |ref| " \
                                                  f"{ref.abs().max().item():.2f})"


def reference_kda(cfg: ModelConfig, w: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """Float64, token by token, straight from the definition; shares no code with the layer."""
    n, heads, d, width = x.shape[0], cfg.kda_num_heads, cfg.kda_head_dim, cfg.kda_conv_size

    def conv_silu(a: torch.Tensor, kernel: torch.Tensor) -> torch.Tensor:  # a [n, C], kernel [C, 1, W]
        padded = torch.cat([torch.zeros(width - 1, a.shape[1], dtype=a.dtype), a])
        out = sum(padded[i:i + n] * kernel[:, 0, i] for i in range(width))
        return out * torch.sigmoid(out)

    def heads_of(a: torch.Tensor) -> torch.Tensor:
        return a.view(n, heads, d)

    def unit(a: torch.Tensor) -> torch.Tensor:
        return a / torch.sqrt((a * a).sum(-1, keepdim=True) + 1e-6)

    q, k, v = (heads_of(conv_silu(x @ w[f"{p}_proj.weight"].T, w[f"{p}_conv1d.weight"])) for p in "qkv")
    q, k = unit(q) / d ** 0.5, unit(k)
    raw = heads_of(x @ w["f_a_proj.weight"].T @ w["f_b_proj.weight"].T + w["dt_bias"])
    rate = w["A_log"].exp()[:, None]
    lb = cfg.kda_gate_lower_bound
    decay = lb * torch.sigmoid(rate * raw) if lb is not None else -rate * F.softplus(raw)
    beta = torch.sigmoid(x @ w["b_proj.weight"].T)
    s = torch.zeros(heads, d, d, dtype=torch.float64)
    o = torch.zeros(n, heads, d, dtype=torch.float64)
    for t in range(n):
        for h in range(heads):
            s[h] = s[h] * decay[t, h].exp()[:, None]
            u = beta[t, h] * (v[t, h] - s[h].T @ k[t, h])
            s[h] = s[h] + torch.outer(k[t, h], u)
            o[t, h] = s[h].T @ q[t, h]
    gate = x @ w["g_proj.weight"].T if cfg.kda_full_rank_gate else x @ w["g_a_proj.weight"].T @ w["g_b_proj.weight"].T
    normed = o / torch.sqrt((o * o).mean(-1, keepdim=True) + 1e-5) * w["o_norm.weight"]  # vLLM: fixed eps
    return (normed * torch.sigmoid(heads_of(gate))).reshape(n, heads * d) @ w["o_proj.weight"].T


def test_full_rank_gate_with_lower_bound_matches_float64_reference():
    """K3's layer: a 70-token prefill then 3 decodes through the rows, against the float64 loop."""
    cfg = K3_BOUNDED
    layer = build_layer(cfg, seed=7)
    x = hidden(73, cfg, seed=8)
    ref = reference_kda(cfg, logical_weights(cfg, seed=7), x.double())
    state = nan_state(cfg)
    outs = [run(layer, x[:70], [(70, 0, 2)], state)]
    outs += [run(layer, x[t:t + 1], [(1, t, 2)], state) for t in range(70, 73)]
    out = torch.cat(outs)
    diff = max_diff(out, ref)
    assert diff < 2e-5 * ref.abs().max().item(), f"max abs diff {diff:.2e} against the float64 reference"
    # The bound must matter here, else a layer that ignored it would pass.
    unbounded = reference_kda(K3, logical_weights(cfg, seed=7), x.double())
    assert max_diff(unbounded, ref) > 100 * diff


# ---- TP 2 ---------------------------------------------------------------------------------------

TP_CONFIGS = {"linear": LINEAR, "k3-bounded": K3_BOUNDED}


def tp_scenario(cfg: ModelConfig, tp: TPGroup) -> list[torch.Tensor]:
    """A prefill, then a mixed step (decode + continuation + fresh prefill), then a decode step."""
    layer = build_layer(cfg, tp, seed=9)
    state = nan_state(cfg, tp.world_size)
    a, b, c = hidden(40, cfg, seed=20), hidden(80, cfg, seed=21), hidden(9, cfg, seed=22)
    return [
        run(layer, torch.cat([a[:30], b[:66]]), [(30, 0, 1), (66, 0, 2)], state),
        run(layer, torch.cat([a[30:31], b[66:79], c[:8]]), [(1, 30, 1), (13, 66, 2), (8, 0, 3)], state),
        run(layer, torch.cat([a[31:32], b[79:80], c[8:9]]), [(1, 31, 1), (1, 79, 2), (1, 8, 3)], state),
    ]


def tp_worker(tp: TPGroup, out_dir: str) -> None:
    results = {name: tp_scenario(cfg, tp) for name, cfg in TP_CONFIGS.items()}
    torch.save(results, os.path.join(out_dir, f"rank{tp.rank}.pt"))


def test_tp2_matches_tp1(tmp_path):
    run_tp(2, str(tmp_path), tp_worker, str(tmp_path))
    for name, cfg in TP_CONFIGS.items():
        single = tp_scenario(cfg, TPGroup.single())
        for rank in range(2):
            got = torch.load(tmp_path / f"rank{rank}.pt")[name]
            for step, (o2, o1) in enumerate(zip(got, single)):
                assert_close(o2, o1, f"{name} step {step} at TP 2 rank {rank}", tol=1e-5)
