"""The MoE entry kernel (service/model/moe_entry.py): latent down-projection, the shared experts'
gate/up with SiLU/SiTU, and fp32 router logits in one launch, against the separate torch ops and
a float64 reference (FP8 weights: of the dequantized ones); and a latent MoE layer choosing it
with the same output as the separate path.

Runs on CUDA, or on a CPU with Triton installed and TRITON_INTERPRET=1 (kernels interpreted).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_env import DEVICE, INTERPRET, kernel_marks, require_kernel_device, skip_interpreted_16bit_dot

require_kernel_device()

from service.config import PRESETS  # noqa: E402
from service.model import layers, moe_entry  # noqa: E402
from service.model.moe import MoE  # noqa: E402
from service.parallel import TPGroup  # noqa: E402
from service.weights import fp8 as fmt  # noqa: E402

pytestmark = kernel_marks(300)


def check_entry(m: int, k: int, act: str, beta: float, linear_beta: float | None, dtype: torch.dtype, seed: int,
                logit_tol: float) -> None:
    """The entry op on m rows against float64 references of the three projections and the
    activation (latent 40, shared 24, 20 experts: none a multiple of the 4-16-row blocks)."""
    g = torch.Generator().manual_seed(seed)
    latent, inter, experts = 40, 24, 20
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    down = (torch.randn(latent, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    shared = (torch.randn(2 * inter, k, generator=g) * 2 / k ** 0.5).to(DEVICE, dtype)
    router = (torch.randn(experts, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    assert moe_entry.supported(x, down, shared, router, act)
    lat, h, logits = torch.ops.latentserve.moe_entry(x, down, shared, router, act, beta, linear_beta)
    assert (lat.shape, h.shape, logits.shape) == ((m, latent), (m, inter), (m, experts))
    assert (lat.dtype, h.dtype, logits.dtype) == (dtype, dtype, torch.float32)
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    xd = x.double()
    torch.testing.assert_close(lat.double(), xd @ down.double().t(), atol=4 * tol, rtol=tol)
    torch.testing.assert_close(logits.double(), xd @ router.double().t(), atol=logit_tol, rtol=logit_tol)
    gu = xd @ shared.double().t()
    gd, ud = gu[:, :inter], gu[:, inter:]
    if act == "silu":
        ref = torch.nn.functional.silu(gd) * ud
    else:
        ref = beta * torch.tanh(gd / beta) * torch.sigmoid(gd) * (linear_beta * torch.tanh(ud / linear_beta))
    torch.testing.assert_close(h.double(), ref, atol=8 * tol, rtol=2 * tol)


@pytest.mark.parametrize("act,beta,linear_beta", [("silu", 1.0, None), ("situ", 4.0, 8.0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k,whole_k", [(96, False), (1100, False), (96, True), (2100, True)])
def test_entry_matches_separate_ops(act, beta, linear_beta, dtype, k, whole_k, monkeypatch):
    """One row, K in one step and in several: whole-K slices (2048-wide steps: 2100 takes two) and
    LATENTSERVE_MOE_ENTRY_WHOLE_K=0's 512-wide steps."""
    monkeypatch.setenv("LATENTSERVE_MOE_ENTRY_WHOLE_K", "1" if whole_k else "0")
    check_entry(1, k, act, beta, linear_beta, dtype, 7, 1e-5)


@pytest.mark.parametrize("act,beta,linear_beta", [("silu", 1.0, None), ("situ", 4.0, 8.0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,k", [(3, 96), (16, 600), (40, 96), (130, 96), (256, 600)])
def test_entry_rows_match_separate_ops(act, beta, linear_beta, dtype, m, k):
    """From 2 rows on tensor-core tiles (16 and 64-row tiles, K in one step and several), and
    above 64 rows in row blocks of 64 (130: a partial block)."""
    skip_interpreted_16bit_dot(dtype)
    check_entry(m, k, act, beta, linear_beta, dtype, m + k, 1e-4)


@pytest.mark.parametrize("cfg", [{"BLOCK_N": 32, "BLOCK_K": 64, "num_warps": 8, "num_stages": 2},
                                 {"BLOCK_N": 16, "BLOCK_K": 512, "num_warps": 4, "num_stages": 2},
                                 {"BLOCK_N": 32, "BLOCK_K": 256, "num_warps": 4, "num_stages": 2}])
def test_entry_rows_launch_shapes_give_the_same_outputs(cfg):
    """bench/moe_entry.py's sweep overrides the multi-row launch (`_entry`'s cfg): wider output
    blocks and K steps narrower or wider than K give the default launch's outputs (fp32, whose
    512-wide stages take twice bf16's shared memory: 2 stages, where 4 asked 240 KB of 227 on an
    H100 in run 73)."""
    g = torch.Generator().manual_seed(3)
    x, down, shared, router = (torch.randn(n, 600, generator=g).to(DEVICE) / 600 ** 0.5 for n in (8, 40, 48, 20))
    want = moe_entry._entry(x, down, shared, router, "silu", 1.0, None)
    got = moe_entry._entry(x, down, shared, router, "silu", 1.0, None, cfg=cfg)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_wide_n_switch_picks_its_launch(monkeypatch):
    """LATENTSERVE_MOE_ENTRY_WIDE_N=1: 32 outputs a program at 4 stages for 16-row tiles of 16-bit
    weights, the default's launch for FP8, fp32 and wider row tiles."""
    monkeypatch.setenv("LATENTSERVE_MOE_ENTRY_WIDE_N", "0")
    default = moe_entry._rows_launch(16, 2048, 2)
    assert (default["BLOCK_N"], default["BLOCK_K"], default["num_stages"]) == (16, 256, 3)
    monkeypatch.delenv("LATENTSERVE_MOE_ENTRY_WIDE_N")  # on by default since run 105
    assert moe_entry._rows_launch(16, 2048, 2) == {**default, "BLOCK_N": 32, "num_stages": 4}
    for weight_bytes in (1, 4):  # FP8, and fp32 (whose 4 stages overflow shared memory)
        assert moe_entry._rows_launch(16, 2048, weight_bytes) == default
    assert moe_entry._rows_launch(64, 2048, 2)["BLOCK_N"] == 16


def test_entry_rows_in_a_latent_moe_layer(monkeypatch):
    """Five tokens through a latent MoE layer: the multi-row entry kernel's output equals the
    separate ops' (router, latent down, shared gate/up: LATENTSERVE_MOE_ENTRY_MAX_ROWS=1)."""
    layer, x = latent_moe_layer("k3-tiny")
    x = torch.randn(5, x.shape[1], generator=torch.Generator().manual_seed(5)).to(DEVICE)
    monkeypatch.setenv("LATENTSERVE_MOE_ENTRY_MAX_ROWS", "1")
    assert layer._entry(x) is None
    separate = layer(x)
    monkeypatch.delenv("LATENTSERVE_MOE_ENTRY_MAX_ROWS")
    assert layer._entry(x) is not None
    torch.testing.assert_close(layer(x), separate, atol=1e-5, rtol=1e-4)


def test_not_for_more_rows_or_other_dtypes(monkeypatch):
    w = torch.randn(16, 32).to(DEVICE)
    assert moe_entry.supported(torch.randn(256, 32).to(DEVICE), w, w, w, "silu")
    assert not moe_entry.supported(torch.randn(257, 32).to(DEVICE), w, w, w, "silu")
    monkeypatch.setenv("LATENTSERVE_MOE_ENTRY_MAX_ROWS", "1")
    assert not moe_entry.supported(torch.randn(2, 32).to(DEVICE), w, w, w, "silu")
    assert not moe_entry.supported(torch.randn(1, 32).to(DEVICE), w, w, w, "gelu")
    assert not moe_entry.supported(torch.randn(1, 32).to(DEVICE), w.to(torch.bfloat16), w, w, "silu")


def latent_moe_layer(preset: str, dtype: torch.dtype = torch.float32) -> tuple[MoE, torch.Tensor]:
    """A TP-1 latent MoE layer of `preset` with small random weights (norms near 1), and one token."""
    cfg = dataclasses.replace(PRESETS[preset])
    torch.manual_seed(0)
    layer = MoE(cfg, TPGroup.single(), layer_idx=1, dtype=dtype, tail=None).to(DEVICE)
    for name, p in layer.named_parameters():
        p.data = (torch.randn_like(p) * (0.02 if p.dim() > 1 else 0.1)).to(p.dtype)
        if name.endswith("norm.weight"):
            p.data = 1.0 + p.data
    return layer, torch.randn(1, cfg.hidden_size).to(DEVICE, dtype)


@pytest.mark.parametrize("preset", ["k3-tiny"])
def test_latent_moe_layer_same_output(preset, monkeypatch):
    """One token through a latent MoE layer: the entry kernel path equals the separate ops'."""
    layer, x = latent_moe_layer(preset)
    cfg = PRESETS[preset]
    assert layer._entry(x) is not None
    fused = layer(x)
    monkeypatch.setenv("LATENTSERVE_MOE_ENTRY", "0")
    assert layer._entry(x) is None
    separate = layer(x)
    torch.testing.assert_close(fused, separate, atol=1e-5, rtol=1e-4)
    assert layers.act_params(cfg)[0] == "situ"


# The interpreter's tl.dot takes no bf16 (test_fp8.py's note); FP8 loads work there.
FP8_ACT = torch.float16 if INTERPRET else torch.bfloat16


@pytest.mark.parametrize("act,beta,linear_beta", [("silu", 1.0, None), ("situ", 4.0, 8.0)])
@pytest.mark.parametrize("m,k", [(1, 300), (1, 2100), (5, 300), (40, 600), (130, 300)])
def test_fp8_entry_matches_dequantized_reference(act, beta, linear_beta, m, k):
    """FP8 latent down and shared gate/up in 128 x 128 blocks, the router in the activations'
    dtype: against float64 of the dequantized weights. One row (K in one step and three), tensor-
    core tiles, 64-row blocks. The shared width 192 puts the up rows' scales in other blocks than
    the gate rows' (up row 0 is in block 1), a partial K block (300) and a partial latent block (200)."""
    g = torch.Generator().manual_seed(m + k)
    latent, inter, experts = 200, 192, 20
    x = torch.randn(m, k, generator=g).to(DEVICE, FP8_ACT)
    down, down_s = fmt.quantize(torch.randn(latent, k, generator=g) / k ** 0.5, (128, 128))
    shared, shared_s = fmt.quantize(torch.randn(2 * inter, k, generator=g) * 2 / k ** 0.5, (128, 128))
    router = (torch.randn(experts, k, generator=g) / k ** 0.5).to(DEVICE, FP8_ACT)
    down, down_s, shared, shared_s = (t.to(DEVICE) for t in (down, down_s, shared, shared_s))
    assert moe_entry.supported(x, down, shared, router, act, down_s, shared_s)
    assert not moe_entry.supported(x, down, shared, router, act, down_s, None)
    lat, h, logits = torch.ops.latentserve.moe_entry(x, down, shared, router, act, beta, linear_beta, down_s, shared_s)
    assert (lat.dtype, h.dtype, logits.dtype) == (FP8_ACT, FP8_ACT, torch.float32)
    xd = x.double()
    ref_lat = xd @ fmt.dequantize(down, down_s, (128, 128)).double().t()
    # One rounding of the output, plus the 16-bit rounding of each scaled weight tile on tensor cores.
    assert (lat.double() - ref_lat).abs().max() <= 2 ** -7 * ref_lat.abs().max() + 1e-3
    torch.testing.assert_close(logits.double(), xd @ router.double().t(), atol=1e-3, rtol=1e-3)
    gu = xd @ fmt.dequantize(shared, shared_s, (128, 128)).double().t()
    gd, ud = gu[:, :inter], gu[:, inter:]
    if act == "silu":
        ref = torch.nn.functional.silu(gd) * ud
    else:
        ref = beta * torch.tanh(gd / beta) * torch.sigmoid(gd) * (linear_beta * torch.tanh(ud / linear_beta))
    assert (h.double() - ref).abs().max() <= 2 ** -6 * ref.abs().max() + 2e-3


@pytest.mark.parametrize("tokens", [1, 5])
def test_fp8_latent_moe_layer_takes_the_entry_kernel(tokens, monkeypatch, spy):
    """An FP8 latent MoE layer (latent down, shared gate/up and shared down quantized, the latent
    up in 16 bits, as an FP8 checkpoint holds them) runs the entry kernel and the paired
    up + shared-down launch with their scales, and its output is the separate path's."""
    layer, _ = latent_moe_layer("k3-tiny", FP8_ACT)
    shared = layer.shared_experts
    for mod in (layer.routed_expert_down_proj, shared.gate_up_proj, shared.down_proj):
        q, s = fmt.quantize(mod.weight.float().cpu(), (128, 128))
        mod.weight = torch.nn.Parameter(q.to(DEVICE), requires_grad=False)
        mod.weight_scale_inv = torch.nn.Parameter(s.to(DEVICE), requires_grad=False)
    x = torch.randn(tokens, layer.routed_expert_down_proj.weight.shape[1],
                    generator=torch.Generator().manual_seed(tokens)).to(DEVICE, FP8_ACT)
    assert layer._entry(x) is not None
    pairs = spy(torch.ops.latentserve, "gemv_pair_normed" if tokens == 1 else "gemv_pair")
    fused = layer(x)
    assert pairs  # one row: the latent norm in the pair too
    monkeypatch.setenv("LATENTSERVE_MOE_ENTRY", "0")
    assert layer._entry(x) is None
    torch.testing.assert_close(fused, layer(x), atol=2e-3, rtol=2e-2)
