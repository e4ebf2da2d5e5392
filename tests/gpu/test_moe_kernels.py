"""The Triton MoE decode kernels (service/model/moe_kernels.py) against the torch path: routing
(sigmoid and softmax, grouped and not) chooses the same experts with the same weights, and the
GEMV experts match a float64 reference of the gated experts (SiLU and SiTU, with and without
the up clip) and the grouped/per-expert torch path.

Runs on CUDA, or on a CPU with Triton installed and TRITON_INTERPRET=1 (kernels interpreted).
"""

from __future__ import annotations

import pytest
import torch
from kernel_env import (
    DEVICE,
    GRAPH_SHAPES,
    INTERPRET,
    experts_reference,
    graph_steps,
    kernel_marks,
    rel_error,
    require_kernel_device,
    skip_interpreted_16bit_dot,
)

require_kernel_device()

from service.model import moe, moe_down_early, moe_kernels  # noqa: E402

pytestmark = kernel_marks(300)


@pytest.mark.parametrize("experts,top_k,n_group,topk_group,softmax,norm", [
    (64, 8, 8, 4, False, True),  # DeepSeek-V3-shaped (small preset)
    (16, 4, 4, 2, False, True),  # k3-tiny
    (48, 6, 1, 1, False, False),  # experts not a power of 2, ungrouped, k not a power of 2
    (32, 4, 1, 1, True, True),  # softmax scoring
    (896, 16, 1, 1, False, True),  # Kimi-K3: 896 experts (padded to 1024), top 16
])
def test_route_matches_torch(experts, top_k, n_group, topk_group, softmax, norm):
    g = torch.Generator().manual_seed(experts + top_k)
    m, hidden = 5, 96
    x = torch.randn(m, hidden, generator=g).to(DEVICE)
    w = torch.randn(experts, hidden, generator=g).to(DEVICE)
    bias = (torch.randn(experts, generator=g) * 0.1).to(DEVICE)
    args = (x, w, bias, n_group, topk_group, top_k, norm, 2.5, softmax)
    assert moe_kernels.route_supported(x, experts, n_group)
    ref_w, ref_ids = moe.route.eager(*args)
    got_w, got_ids = torch.ops.latentserve.moe_route(*args)
    assert got_ids.dtype == torch.long and got_w.dtype == torch.float32
    # Same experts per token (the order of the k slots is free), same weight per expert.
    ref_order, got_order = ref_ids.sort(dim=1), got_ids.sort(dim=1)
    assert torch.equal(ref_order.values, got_order.values)
    torch.testing.assert_close(got_w.gather(1, got_order.indices), ref_w.gather(1, ref_order.indices),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lean", [{"LATENTSERVE_ROUTE_SELECT_WARPS": "1"}, {"LATENTSERVE_ROUTE_SELECT_GATHER": "1"},
                                  {"LATENTSERVE_ROUTE_SELECT_WARPS": "1", "LATENTSERVE_ROUTE_SELECT_GATHER": "1"}])
@pytest.mark.parametrize("experts,top_k,n_group,topk_group,softmax,norm", [
    (64, 8, 8, 4, False, True), (48, 6, 1, 1, False, False), (32, 4, 1, 1, True, True), (896, 16, 1, 1, False, True)])
def test_lean_selection_is_bit_equal(monkeypatch, lean, experts, top_k, n_group, topk_group, softmax, norm):
    """The selection on one warp, and with the chosen scores reloaded from their logits
    (moe_select.launch_options, both the default since run 105): the same experts in the same
    slots and bit-equal weights as on 4 warps without the reload."""
    g = torch.Generator().manual_seed(experts)
    x = torch.randn(5, 96, generator=g).to(DEVICE)
    w = torch.randn(experts, 96, generator=g).to(DEVICE)
    bias = (torch.randn(experts, generator=g) * 0.1).to(DEVICE)
    args = (x, w, bias, n_group, topk_group, top_k, norm, 2.5, softmax)
    monkeypatch.setenv("LATENTSERVE_ROUTE_SELECT_WARPS", "0")
    monkeypatch.setenv("LATENTSERVE_ROUTE_SELECT_GATHER", "0")
    ref_w, ref_ids = torch.ops.latentserve.moe_route(*args)
    for name, value in lean.items():
        monkeypatch.setenv(name, value)
    got_w, got_ids = torch.ops.latentserve.moe_route(*args)
    assert torch.equal(got_ids, ref_ids) and torch.equal(got_w, ref_w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,experts,n_group,topk_group", [(128, 64, 8, 4), (300, 896, 1, 1), (130, 48, 1, 1)])
def test_token_tiled_router_logits_match_torch(monkeypatch, dtype, m, experts, n_group, topk_group):
    """From tiled_logits_tokens() tokens the logits come from 16 x 16 token/expert tiles (token
    counts and expert counts that end mid-tile, a hidden size that ends mid-step): the same
    experts and weights as the fp32 torch route, and the per-token kernel's."""
    skip_interpreted_16bit_dot(dtype)
    g = torch.Generator().manual_seed(m + experts)
    hidden = 200
    x = torch.randn(m, hidden, generator=g).to(DEVICE, dtype)
    w = torch.randn(experts, hidden, generator=g).to(DEVICE, dtype)
    bias = (torch.randn(experts, generator=g) * 0.1).to(DEVICE)
    args = (x, w, bias, n_group, topk_group, 8, True, 2.5, False)
    assert m >= moe_kernels.tiled_logits_tokens() and moe_kernels.route_supported(x, experts, n_group)
    got = torch.ops.latentserve.moe_route(*args)
    refs = [moe.route.eager(*args)]
    if not INTERPRET or m * experts <= 8192:  # the interpreter runs a program per token: minutes at 300 x 896
        monkeypatch.setenv("LATENTSERVE_ROUTE_TILED_TOKENS", str(10**9))
        refs.append(torch.ops.latentserve.moe_route(*args))
    for ref_w, ref_ids in refs:
        ref_order, got_order = ref_ids.sort(dim=1), got[1].sort(dim=1)
        assert torch.equal(ref_order.values, got_order.values)
        torch.testing.assert_close(got[0].gather(1, got_order.indices), ref_w.gather(1, ref_order.indices),
                                   rtol=1e-5, atol=1e-6)


def test_prefill_router_selects_in_the_kernel(monkeypatch):
    """Above route_max_tokens: cuBLAS logits, then the selection kernel; the same experts and
    weights as the torch chain (LATENTSERVE_ROUTE_SELECT=0)."""
    from service.config import PRESETS

    cfg = PRESETS["small"]
    router = moe.TopkRouter(cfg, torch.float32).to(DEVICE)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        router.weight.copy_(torch.randn(router.weight.shape, generator=g))
        router.e_score_correction_bias.copy_(torch.randn(router.e_score_correction_bias.shape, generator=g) * 0.1)
    monkeypatch.setenv("LATENTSERVE_ROUTE_MAX_TOKENS", "4")
    x = torch.randn(9, cfg.hidden_size, generator=g).to(DEVICE)
    assert not moe_kernels.route_supported(x, cfg.n_routed_experts, cfg.n_group)
    assert moe_kernels.select_supported(x, cfg.n_routed_experts, cfg.n_group)
    got_w, got_ids = router(x)
    monkeypatch.setenv("LATENTSERVE_ROUTE_SELECT", "0")
    assert not moe_kernels.select_supported(x, cfg.n_routed_experts, cfg.n_group)
    ref_w, ref_ids = router(x)
    ref_order, got_order = ref_ids.sort(dim=1), got_ids.sort(dim=1)
    assert torch.equal(ref_order.values, got_order.values)
    torch.testing.assert_close(got_w.gather(1, got_order.indices), ref_w.gather(1, ref_order.indices),
                               rtol=1e-5, atol=1e-6)


def situ(beta, linear_beta):
    def act(g, u):
        h = beta * torch.tanh(g / beta) * torch.sigmoid(g)
        return h * (linear_beta * torch.tanh(u / linear_beta) if linear_beta else u)
    return act


@pytest.mark.parametrize("act,beta,linear_beta", [("silu", 1.0, None), ("situ", 4.0, 8.0), ("situ", 2.0, None)])
@pytest.mark.parametrize("m,top_k", [(1, 8), (3, 4), (16, 2)])
def test_experts_match_float64(act, beta, linear_beta, m, top_k):
    g = torch.Generator().manual_seed(m * 10 + top_k)
    experts, width, shard = 12, 160, 48  # not multiples of the blocks: the masks are exercised
    x = torch.randn(m, width, generator=g)
    w13 = torch.randn(experts, 2 * shard, width, generator=g) * 0.1
    w2 = torch.randn(experts, width, shard, generator=g) * 0.1
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(m)])
    weights = torch.rand(m, top_k, generator=g)
    fn = (lambda a, b: torch.nn.functional.silu(a) * b) if act == "silu" else situ(beta, linear_beta)
    ref = experts_reference(x, w13, w2, weights, ids, fn)
    dev = [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]
    got = torch.ops.latentserve.moe_experts(*dev, act, beta, linear_beta)
    assert got.shape == (m, width) and got.dtype == torch.float32
    torch.testing.assert_close(got.double().cpu(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("early", ["1", "32"])
@pytest.mark.parametrize("m,top_k,shard", [(1, 8, 48), (3, 4, 64), (2, 8, 200)])
def test_down_early_matches_float64(monkeypatch, early, m, top_k, shard):
    """LATENTSERVE_MOE_DOWN_EARLY (moe_down_early.py, its slab loaded before the PDL wait): the
    shard as two power-of-2 spans (48 = 32 + 16; 200 = 128 + a masked 128) or one (64), output rows
    that end mid-block; the float64 reference and the default down kernel's parts."""
    g = torch.Generator().manual_seed(m * 100 + shard)
    experts, width = 12, 160
    x = torch.randn(m, width, generator=g)
    w13 = torch.randn(experts, 2 * shard, width, generator=g) * 0.1
    w2 = torch.randn(experts, width, shard, generator=g) * 0.1
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(m)])
    weights = torch.rand(m, top_k, generator=g)
    silu = lambda a, b: torch.nn.functional.silu(a) * b  # noqa: E731
    dev = [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]
    base = torch.ops.latentserve.moe_experts_parts(*dev, "silu", 1.0, None)
    monkeypatch.setenv("LATENTSERVE_MOE_DOWN_EARLY", early)
    assert moe_down_early.supported(m * top_k, shard) and not moe_down_early.supported(32, shard)
    got = torch.ops.latentserve.moe_experts_parts(*dev, "silu", 1.0, None)
    torch.testing.assert_close(got, base, rtol=1e-5, atol=1e-5)
    summed = got.view(m, top_k, width).sum(dim=1)
    torch.testing.assert_close(summed.double().cpu(), experts_reference(x, w13, w2, weights, ids, silu), rtol=1e-4,
                               atol=1e-4)


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs and PDL on the GPU only")
def test_decode_graphs_with_the_early_down_kernel_match_the_eager_step(monkeypatch):
    """Under PDL the early kernel reads the routing before its wait, from two kernels back: decode
    graphs of `tiny` (bf16, routed densely) at 1 and 4 sequences with it on, against the eager step
    with it on and off."""
    steps = graph_steps(monkeypatch, "LATENTSERVE_MOE_DOWN_EARLY", "1", GRAPH_SHAPES)
    for rows, step in steps.items():
        assert any("_down_early_kernel" in n for n in step.kernels), (rows, sorted(set(step.kernels)))
        graph_err, kernel_err = step.errors()
        assert graph_err < 3e-2 and kernel_err < 3e-2, (rows, graph_err, kernel_err)


def test_down_early_spans():
    assert [moe_down_early.spans(s) for s in (768, 384, 1024, 48, 200, 1)] == [
        (512, 256), (256, 128), (1024, 0), (32, 16), (128, 128), (1, 0)]
    assert not moe_down_early.supported(8, moe_down_early.MAX_SHARD + 1)


@pytest.mark.skipif(INTERPRET, reason="bf16 on the GPU only")
@pytest.mark.parametrize("early", ["0", "1", "32"])
@pytest.mark.parametrize("m", [1, 8])
def test_experts_bf16_match_the_torch_path(monkeypatch, early, m):
    monkeypatch.setenv("LATENTSERVE_MOE_DOWN_EARLY", early)  # 1 token: its slab before the PDL wait
    from service.config import PRESETS

    cfg = PRESETS["small"]
    g = torch.Generator().manual_seed(m)
    width, shard, e, k = cfg.moe_latent_size, cfg.moe_intermediate_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    x = torch.randn(m, width, generator=g).cuda().bfloat16()
    w13 = (torch.randn(e, 2 * shard, width, generator=g) * 0.02).cuda().bfloat16()
    w2 = (torch.randn(e, width, shard, generator=g) * 0.02).cuda().bfloat16()
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]).cuda()
    weights = torch.rand(m, k, generator=g).cuda()
    got = torch.ops.latentserve.moe_experts(x, w13, w2, weights, ids, "silu", 1.0, None)
    ref = experts_reference(x.float().cpu(), w13.float().cpu(), w2.float().cpu(), weights.cpu(), ids.cpu(),
                    lambda a, b: torch.nn.functional.silu(a) * b)
    err = (got.double().cpu() - ref).abs().max().item()
    assert err < 2e-2 * ref.abs().max().item(), err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,top_k,width", [(1, 8, 1024), (5, 8, 600), (40, 16, 96)])
def test_slot_sum_norm_equals_the_sum_then_rms_norm(dtype, m, top_k, width):
    """moe_slot_sum_norm: each token's slot sum rounded to the model dtype, then tail.rms_norm's
    math (a width that is not a power of two masks the row's end)."""
    from service.tail.base import rms_norm

    g = torch.Generator().manual_seed(m + width)
    parts = (torch.randn(m * top_k, width, generator=g) * 3).to(DEVICE)
    weight = (1 + 0.1 * torch.randn(width, generator=g)).to(DEVICE, dtype)
    got = torch.ops.latentserve.moe_slot_sum_norm(parts, top_k, weight, 1e-6)
    summed = moe_kernels.slot_sum(parts, torch.empty(m, width, dtype=dtype, device=DEVICE), top_k)
    ref = rms_norm(summed, weight, 1e-6)
    assert got.shape == (m, width) and got.dtype == dtype
    # The same roundings; only the fp32 mean's order of addition differs (one ulp of the dtype at most).
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(got.double(), ref.double(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tokens", [(torch.float32, 5), (torch.bfloat16, 8), (torch.bfloat16, 40)])
def test_latent_moe_with_the_norm_in_the_slot_sum(dtype, tokens, monkeypatch, spy):
    """LATENTSERVE_MOE_SLOT_NORM=1 (the default): from two tokens the latent MoE's norm runs in the
    experts' slot-sum kernel (GEMV experts' parts at 5 tokens in fp32, the grouped GEMM's in bf16)
    with the layer's output that of the norm as a kernel of its own (=0)."""
    from test_moe_entry import latent_moe_layer

    skip_interpreted_16bit_dot(dtype)
    layer, x = latent_moe_layer("k3-tiny", dtype)
    x = torch.randn(tokens, x.shape[1], generator=torch.Generator().manual_seed(tokens)).to(DEVICE, dtype)
    with torch.no_grad():
        monkeypatch.setenv("LATENTSERVE_MOE_SLOT_NORM", "0")
        ref = layer(x)
        monkeypatch.setenv("LATENTSERVE_MOE_SLOT_NORM", "1")
        calls = spy(torch.ops.latentserve, "moe_slot_sum_norm")
        got = layer(x)
    assert len(calls) == 1
    err = rel_error(got, ref)
    assert err < (1e-6 if dtype == torch.float32 else 1e-2), f"relative error {err:.2e}"
