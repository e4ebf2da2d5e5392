"""Several projections of the same rows in one launch (model/gemv_multi.py) against float64 and
against one gemv a weight: widths that end mid-block, one to six weights, one row (the register
product) and 5 / 40 rows (tensor-core tiles, on the GPU). Runs on CUDA, or on a CPU with Triton
installed and TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEVICE, fill_random, kernel_marks, require_kernel_device, skip_interpreted_16bit_dot

require_kernel_device()

from service.model import gemv_multi  # noqa: E402

pytestmark = kernel_marks(300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize("widths,k", [([96, 96, 96, 100, 40], 96), ([2048, 2048, 2048, 2048, 128], 2048),
                                      ([64, 16], 200), ([8, 24, 40, 56, 72, 88], 64)])
def test_multi_equals_each_projection(dtype, m, widths, k, monkeypatch):
    if m > 1:  # tensor-core tiles
        skip_interpreted_16bit_dot(dtype)
    monkeypatch.setenv("LATENTSERVE_GEMV_MULTI", "1")
    g = torch.Generator().manual_seed(sum(widths) + k + m)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    ws = [(torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype) for n in widths]
    assert gemv_multi.supported(x, ws)
    y = gemv_multi.run(x, ws)
    assert y.shape == (m, sum(widths)) and y.dtype == dtype
    ref = torch.cat([x.double() @ w.double().t() for w in ws], dim=1)
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.double(), ref, atol=tol * 4, rtol=tol)
    # Each segment is the GEMV of its weight alone: the same tiles over the same K steps.
    alone = torch.cat([torch.ops.latentserve.gemv(x, w) for w in ws], dim=1)
    torch.testing.assert_close(y.double(), alone.double(), atol=tol * 4, rtol=tol)


def test_supported_needs_the_switch_and_gemv_shapes(monkeypatch):
    x = torch.randn(1, 64).to(DEVICE)
    ws = [torch.randn(32, 64).to(DEVICE) for _ in range(3)]
    monkeypatch.setenv("LATENTSERVE_GEMV_MULTI", "0")
    assert not gemv_multi.supported(x, ws)  # switched off
    monkeypatch.delenv("LATENTSERVE_GEMV_MULTI")  # on by default since run 61
    assert gemv_multi.supported(x, ws)
    assert not gemv_multi.supported(x, ws[:1])  # one weight is a plain gemv
    assert not gemv_multi.supported(x, ws * 3)  # more than MAX_SEGMENTS
    assert not gemv_multi.supported(x, [ws[0], torch.randn(32, 63).to(DEVICE)])  # another K
    assert not gemv_multi.supported(x, [ws[0], ws[1].t().contiguous().t()])  # not row-major


@pytest.mark.parametrize("preset,tokens", [("k3-tiny", 1), ("k3-tiny", 5), ("linear", 3)])
def test_kda_layer_reads_its_input_in_one_launch(preset, tokens, monkeypatch, spy):
    """A KDA layer's q, k, v, gate and forget-gate inputs from one gemv_multi launch (Kimi-K3's
    full-rank gate, and Kimi-Linear's low-rank one): the layer's output and state unchanged."""
    import dataclasses

    from service.config import PRESETS
    from service.engine.plan import SeqChunk
    from service.model.attn_metadata import AttnMetadata
    from service.model.kda import KDAState, KimiDeltaAttention, kda_state_shapes
    from service.parallel import TPGroup

    cfg = PRESETS["k3-tiny"]
    if preset == "linear":
        cfg = dataclasses.replace(cfg, linear_attn_config={**cfg.linear_attn_config, "use_full_rank_gate": False})
    layer = KimiDeltaAttention(cfg, TPGroup.single(), 0, torch.float32)
    g = torch.Generator().manual_seed(tokens)
    fill_random(layer, g)
    layer = layer.to(DEVICE).eval()
    layer.backend = "torch"
    meta = AttnMetadata.build([SeqChunk(i, [0], 3 * i + 1, [], state_slot=i + 1) for i in range(tokens)], 16, DEVICE)
    x = torch.randn(tokens, cfg.hidden_size, generator=g).to(DEVICE)

    def state() -> KDAState:
        gs = torch.Generator().manual_seed(7)
        return KDAState(**{k: torch.randn((tokens + 2, *shape), generator=gs).to(DEVICE, dt)
                           for k, (shape, dt) in kda_state_shapes(cfg, 1).items()})

    monkeypatch.setenv("LATENTSERVE_KDA_DECODE_STEP", "0")  # the projections alone, not inside the step kernel's path
    monkeypatch.setenv("LATENTSERVE_GEMV_MULTI", "0")
    with torch.no_grad():
        ref_state, got_state = state(), state()
        ref = layer(x, meta, ref_state)
        monkeypatch.setenv("LATENTSERVE_GEMV_MULTI", "1")
        calls = spy(torch.ops.latentserve, "gemv_multi")
        got = layer(x, meta, got_state)
    assert len(calls) == 1
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
    for part in ("conv", "recurrent"):
        torch.testing.assert_close(getattr(got_state, part), getattr(ref_state, part), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("tokens", [1, 4])
def test_mla_layer_reads_its_down_projection_and_gate_in_one_launch(tokens, monkeypatch, spy):
    """Kimi-K3's MLA: fused_qkv_a and the output gate's g_proj of the same rows from one
    gemv_multi launch; q, the latent and the gate unchanged."""
    from service.config import ModelConfig
    from service.model.attention import MLAAttention
    from service.parallel import TPGroup

    cfg = ModelConfig(num_attention_heads=8, num_key_value_heads=8, q_lora_rank=64, kv_lora_rank=64,
                      qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, hidden_size=128,
                      mla_use_output_gate=True, mla_use_nope=True)
    attn = MLAAttention(cfg, TPGroup.single(), 0, torch.float32)
    g = torch.Generator().manual_seed(tokens)
    fill_random(attn, g)
    attn = attn.to(DEVICE).eval()
    x = torch.randn(tokens, cfg.hidden_size, generator=g).to(DEVICE)
    no_rope = torch.empty(tokens, 8, device=DEVICE)  # NoPE: never read
    monkeypatch.setenv("LATENTSERVE_GEMV_MULTI", "0")
    with torch.no_grad():
        (q_ref, lat_ref), gate_ref = attn.project(x, no_rope, no_rope)
        monkeypatch.setenv("LATENTSERVE_GEMV_MULTI", "1")
        calls = spy(torch.ops.latentserve, "gemv_multi")
        (q, lat), gate = attn.project(x, no_rope, no_rope)
    assert len(calls) == 1
    for got, ref in ((q, q_ref), (lat, lat_ref), (gate, gate_ref)):
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-4)
