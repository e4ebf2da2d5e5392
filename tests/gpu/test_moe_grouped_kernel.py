"""The Triton grouped-GEMM experts (service/model/moe_grouped.py): the on-device alignment against a
numpy reference (skewed routing, empty experts, one expert taking every pair), the experts'
output against a float64 reference (SiLU and SiTU, masked and even tiles, several BLOCK_M),
determinism, and on the GPU: bf16 on the small preset's shapes against the torch grouped path,
FusedExperts' choice of path, and a CUDA-graph capture.

Runs on CUDA, or on a CPU with Triton installed and TRITON_INTERPRET=1 (kernels interpreted;
bf16 is GPU-only: the interpreter's dot does not take it).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from kernel_env import DEVICE, INTERPRET, experts_reference, kernel_marks, rel_error, require_kernel_device

require_kernel_device()

from service.model import moe_grouped, moe_kernels  # noqa: E402
from service.model.kernel_guard import KernelGuard  # noqa: E402

pytestmark = kernel_marks(300)


def align_reference(ids: np.ndarray, num_experts: int, block_m: int):
    flat = ids.reshape(-1)
    rows, blocks = [], []
    for e in range(num_experts):
        pairs = list(np.nonzero(flat == e)[0])
        pad = -len(pairs) % block_m
        rows += pairs + [flat.size] * pad
        blocks += [e] * ((len(pairs) + pad) // block_m)
    return np.array(rows, dtype=np.int64), np.array(blocks, dtype=np.int64)


def routing(kind: str, m: int, k: int, experts: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if kind == "uniform":
        return torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(m)])
    if kind == "few":  # only the first k + 2 experts get tokens, the rest are empty
        return torch.stack([torch.randperm(k + 2, generator=g)[:k] for _ in range(m)])
    if kind == "skewed":  # expert 3 in every token, the others drawn with a steep bias
        p = torch.arange(experts, 0, -1, dtype=torch.float) ** 4
        rest = torch.stack([torch.multinomial(p, k, generator=g) for _ in range(m)])
        rest[:, 0] = torch.where((rest == 3).any(1), rest[:, 0], torch.full((m,), 3))
        return rest
    assert kind == "one"  # one expert takes every pair (k = 1)
    return torch.full((m, k), 5, dtype=torch.long)


@pytest.mark.parametrize("kind,m,k,experts,block_m", [
    ("uniform", 17, 8, 64, 16), ("uniform", 64, 8, 64, 32), ("uniform", 300, 8, 64, 64),
    ("few", 33, 4, 48, 16), ("skewed", 70, 6, 40, 16), ("one", 50, 1, 16, 16), ("one", 129, 1, 8, 64),
    ("uniform", 9, 4, 160, 16),  # many experts (256 bins), most empty
])
def test_align_matches_numpy(kind, m, k, experts, block_m):
    ids = routing(kind, m, k, experts, seed=m + k)
    sorted_pairs, block_expert, used = moe_grouped.align(ids.to(DEVICE), experts, block_m)
    rows, blocks = align_reference(ids.numpy(), experts, block_m)
    assert int(used) == len(blocks) == len(rows) // block_m
    assert len(blocks) <= block_expert.numel() and len(rows) <= sorted_pairs.numel()
    np.testing.assert_array_equal(sorted_pairs[: len(rows)].cpu().numpy(), rows)
    np.testing.assert_array_equal(block_expert[: len(blocks)].cpu().numpy(), blocks)


def activation(act, beta, linear_beta):
    if act == "silu":
        return lambda g, u: torch.nn.functional.silu(g) * u

    def situ(g, u):
        h = beta * torch.tanh(g / beta) * torch.sigmoid(g)
        return h * (linear_beta * torch.tanh(u / linear_beta) if linear_beta else u)
    return situ


def problem(m, k, experts, width, shard, dtype, seed, kind="uniform"):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, width, generator=g)
    w13 = torch.randn(experts, 2 * shard, width, generator=g) * width ** -0.5
    w2 = torch.randn(experts, width, shard, generator=g) * shard ** -0.5
    ids = routing(kind, m, k, experts, seed + 1)
    weights = torch.rand(m, k, generator=g) + 0.1
    dev = [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]
    return (x, w13, w2, weights, ids), dev


DTYPES = [torch.float32, torch.float16] if INTERPRET else [torch.float32, torch.bfloat16]


SILU, SITU_CLIP, SITU = ("silu", 1.0, None), ("situ", 4.0, 8.0), ("situ", 2.0, None)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,width,shard,cfg,act", [
    # widths not multiples of the tiles: every mask on
    (17, 160, 48, (16, 32, 32, 4, 2), SILU), (17, 160, 48, (16, 32, 32, 4, 2), SITU_CLIP),
    (5, 128, 64, (16, 32, 64, 4, 2), SITU),  # a small odd M, even tiles
    (64, 128, 64, None, SILU), (64, 128, 64, None, SITU_CLIP),  # the table's config
    (256, 96, 32, (64, 32, 32, 4, 2), SILU), (256, 96, 32, (64, 32, 32, 4, 2), SITU),
    # the down kernel's own shape (LATENTSERVE_MOE_GROUPED_DOWN_CONFIG): wider outputs, narrower K steps
    (17, 160, 48, (16, 32, 32, 4, 2, (64, 16, 4, 2)), SILU), (256, 96, 32, (64, 32, 32, 4, 2, (128, 16, 4, 3)), SITU),
])
def test_experts_match_float64(dtype, m, width, shard, cfg, act):
    act, beta, linear_beta = act
    k, experts = 4, 12
    ref_args, dev = problem(m, k, experts, width, shard, dtype, seed=m + width)
    if cfg:
        cfg = dict(zip(("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages", "down"), cfg))
        if "down" in cfg:
            cfg["down"] = dict(zip(moe_grouped.DOWN_KEYS, cfg["down"]))
    got = moe_grouped.grouped_experts(*dev, act, beta, linear_beta, cfg=cfg)
    # The reference takes the dtype-rounded inputs, so only the kernels' own roundings remain.
    ref = experts_reference(*(t.to(dtype).float() if t.is_floating_point() else t for t in ref_args),
                    activation(act, beta, linear_beta))
    assert got.shape == (m, width) and got.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    err = ((got.double().cpu() - ref).abs().max() / ref.abs().max()).item()
    assert err < tol, f"max error {err:.2e} of the output's max"


@pytest.mark.parametrize("kind,m,k,experts,block_m", [
    ("uniform", 8, 8, 64, 16), ("skewed", 5, 6, 40, 16), ("few", 16, 4, 48, 16), ("one", 9, 1, 16, 16),
    ("uniform", 3, 8, 12, 32),  # fewer experts than the 32 histogram bins
])
def test_align_in_gate_up_equals_the_align_kernel(kind, m, k, experts, block_m, monkeypatch, spy):
    """LATENTSERVE_MOE_ALIGN_IN_MAX_PAIRS: gate/up's programs lay out their own row blocks from the
    ids (no align launch) and write them for the down kernel: the same output, bit for bit."""
    _, dev = problem(m, k, experts, 96, 32, torch.float32, seed=m + experts, kind=kind)
    cfg = {"BLOCK_M": block_m, "BLOCK_N": 32, "BLOCK_K": 32, "num_warps": 4, "num_stages": 2}
    monkeypatch.setenv("LATENTSERVE_MOE_ALIGN_IN_MAX_PAIRS", "0")
    want = moe_grouped.grouped_experts(*dev, "silu", 1.0, None, cfg=dict(cfg))
    monkeypatch.setenv("LATENTSERVE_MOE_ALIGN_IN_MAX_PAIRS", str(m * k))
    calls = spy(moe_grouped, "align")
    got = moe_grouped.grouped_experts(*dev, "silu", 1.0, None, cfg=dict(cfg))
    assert calls == [], "the align kernel ran"
    assert torch.equal(got, want), (got - want).abs().max()
    monkeypatch.setenv("LATENTSERVE_MOE_ALIGN_IN_MAX_PAIRS", str(m * k - 1))  # one pair past the limit
    moe_grouped.grouped_experts(*dev, "silu", 1.0, None, cfg=dict(cfg))
    assert calls == ["align"]


def test_op_matches_the_function_and_is_deterministic():
    _, dev = problem(24, 4, 12, 64, 32, torch.float32, seed=3, kind="skewed")
    a = torch.ops.latentserve.moe_grouped_experts(*dev, "silu", 1.0, None)
    b = torch.ops.latentserve.moe_grouped_experts(*dev, "silu", 1.0, None)
    assert torch.equal(a, b)
    torch.testing.assert_close(a, moe_grouped.grouped_experts(*dev, "silu", 1.0, None), rtol=0, atol=0)


def test_supported_and_the_torch_switch(monkeypatch):
    x = torch.zeros(20, 64, device=DEVICE, dtype=torch.float16)
    w13 = torch.zeros(4, 32, 64, device=DEVICE, dtype=torch.float16)
    w2 = torch.zeros(4, 64, 16, device=DEVICE, dtype=torch.float16)
    assert moe_grouped.supported(x, w13, w2, "silu")
    assert not moe_grouped.supported(x, w13, w2, "gelu")
    assert not moe_grouped.supported(x.float(), w13.float(), w2.float(), "silu")
    monkeypatch.setenv("LATENTSERVE_MOE_GROUPED", "torch")
    assert not moe_grouped.supported(x, w13, w2, "silu")


def test_config_table_and_override(monkeypatch):
    small = moe_grouped.config(64, 8, 64)
    assert set(small) == {"BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages"}
    assert moe_grouped.config(8192, 8, 64)["BLOCK_M"] >= small["BLOCK_M"]
    monkeypatch.setenv("LATENTSERVE_MOE_GROUPED_CONFIG", "32,64,64,8,3")
    assert moe_grouped.config(64, 8, 64) == {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 8,
                                             "num_stages": 3}
    monkeypatch.setenv("LATENTSERVE_MOE_GROUPED_DOWN_CONFIG", "128,32,4,4")
    assert moe_grouped.config(64, 8, 64)["down"] == {"BLOCK_N": 128, "BLOCK_K": 32, "num_warps": 4, "num_stages": 4}


def tiny_experts(m: int):
    """k3-tiny's experts (SiTU) cut to 8, fp16 (the interpreter's half dtype; bf16 on the GPU below)."""
    from service.config import PRESETS
    from service.model.moe import FusedExperts
    from service.parallel import TPGroup

    cfg = dataclasses.replace(PRESETS["k3-tiny"], n_routed_experts=8, moe_intermediate_size=32)
    ex = FusedExperts(cfg, 64, TPGroup.single(), torch.float16)
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0, 0.125, generator=torch.Generator().manual_seed(1))
    ex = ex.to(DEVICE)
    x = torch.randn(m, 64, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.float16)
    ids = routing("uniform", m, cfg.num_experts_per_tok, 8, seed=3).to(DEVICE)
    weights = torch.rand(m, cfg.num_experts_per_tok, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    ref = experts_reference(x.float().cpu(), ex.w13.float().cpu(), ex.w2.float().cpu(), weights.cpu(), ids.cpu(),
                    activation(ex.act_name, ex.act_beta, ex.act_linear_beta))
    return ex, x, weights, ids, ref


def test_fused_experts_take_the_kernel_above_the_gemv_limit():
    ex, x, weights, ids, ref = tiny_experts(24)
    with torch.inference_mode():
        got = ex(x, weights, ids)
        op = torch.ops.latentserve.moe_grouped_experts(x, ex.w13, ex.w2, weights, ids, ex.act_name, ex.act_beta,
                                                        ex.act_linear_beta)
    assert torch.equal(got, op)
    err = rel_error(got, ref)
    assert err < 1e-2, err


def test_above_max_tokens_only_where_torch_has_no_fast_grouped_gemm(monkeypatch):
    """fp16 (no CUTLASS grouped GEMM in torch) keeps the Triton kernel above the token cap."""
    monkeypatch.setenv("LATENTSERVE_MOE_GROUPED_MAX_TOKENS", "16")
    ex, x, weights, ids, _ = tiny_experts(24)
    with torch.inference_mode():
        got = ex(x, weights, ids)
        op = torch.ops.latentserve.moe_grouped_experts(x, ex.w13, ex.w2, weights, ids, ex.act_name, ex.act_beta,
                                                        ex.act_linear_beta)
    assert torch.equal(got, op)


def test_first_call_failure_falls_back_to_the_torch_path(monkeypatch):
    monkeypatch.setattr(moe_kernels, "GUARD", KernelGuard("moe_kernels"))

    def broken(*args, **kwargs):
        raise RuntimeError("PTX assembly failed")

    monkeypatch.setattr(moe_grouped, "grouped_experts", broken)
    ex, x, weights, ids, ref = tiny_experts(20)
    with torch.inference_mode():
        got = ex(x, weights, ids)
    assert "PTX assembly failed" in moe_kernels.failure() and not moe_grouped.enabled()
    err = rel_error(got, ref)
    assert err < 1e-2, err


# ---- GPU only ---------------------------------------------------------------------------------

def small_experts(dtype=torch.bfloat16):
    from service.config import PRESETS
    from service.model.moe import FusedExperts
    from service.parallel import TPGroup

    cfg = PRESETS["small"]
    ex = FusedExperts(cfg, cfg.moe_latent_size, TPGroup.single(), dtype)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
    return cfg, ex.cuda()


@pytest.mark.skipif(INTERPRET, reason="bf16 and the torch grouped GEMM on the GPU")
@pytest.mark.parametrize("m", [17, 64, 256])
def test_small_preset_bf16_matches_the_torch_grouped_path(m, monkeypatch):
    cfg, ex = small_experts()
    k, e = cfg.num_experts_per_tok, cfg.n_routed_experts
    x = torch.randn(m, cfg.moe_latent_size, device="cuda", dtype=torch.bfloat16)
    ids = routing("uniform", m, k, e, seed=m).cuda()
    weights = torch.rand(m, k, device="cuda") + 0.1
    with torch.inference_mode():
        got = torch.ops.latentserve.moe_grouped_experts(x, ex.w13, ex.w2, weights, ids, "silu", 1.0, None)
        again = torch.ops.latentserve.moe_grouped_experts(x, ex.w13, ex.w2, weights, ids, "silu", 1.0, None)
        torch_path = ex.grouped(x, weights, ids)
        via_forward = ex(x, weights, ids)  # FusedExperts picks the Triton kernel above the GEMV limit
        monkeypatch.setenv("LATENTSERVE_MOE_GROUPED", "torch")
        assert not moe_grouped.supported(x, ex.w13, ex.w2, "silu")
    assert torch.equal(got, again)
    assert torch.equal(via_forward, got)
    ref = experts_reference(x.float().cpu(), ex.w13.float().cpu(), ex.w2.float().cpu(), weights.cpu(), ids.cpu(),
                    activation("silu", 1.0, None))
    scale = ref.norm().item()
    err = (got.double().cpu() - ref).norm().item() / scale
    err_torch = (torch_path.double().cpu() - ref).norm().item() / scale
    assert err < 1e-2 and err < 2 * err_torch + 1e-3, (err, err_torch)


@pytest.mark.skipif(INTERPRET, reason="torch._grouped_mm's CUTLASS kernels on the GPU")
def test_bf16_above_max_tokens_takes_torch_grouped_mm(monkeypatch):
    from service.model.moe import grouped_mm_fast

    cfg, ex = small_experts()
    m, k, e = 40, cfg.num_experts_per_tok, cfg.n_routed_experts
    x = torch.randn(m, cfg.moe_latent_size, device="cuda", dtype=torch.bfloat16)
    ids = routing("uniform", m, k, e, seed=5).cuda()
    weights = torch.rand(m, k, device="cuda")
    if not grouped_mm_fast(x):
        pytest.skip("no CUTLASS grouped GEMM on this GPU")
    monkeypatch.setenv("LATENTSERVE_MOE_GROUPED_MAX_TOKENS", "32")
    with torch.inference_mode():
        torch.testing.assert_close(ex(x, weights, ids), ex.grouped(x, weights, ids), rtol=0, atol=0)


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs")
def test_captures_in_a_cuda_graph():
    cfg, ex = small_experts()
    m, k, e = 64, cfg.num_experts_per_tok, cfg.n_routed_experts
    x = torch.randn(m, cfg.moe_latent_size, device="cuda", dtype=torch.bfloat16)
    ids = routing("uniform", m, k, e, seed=1).cuda()
    weights = torch.rand(m, k, device="cuda") + 0.1
    op = torch.ops.latentserve.moe_grouped_experts
    with torch.inference_mode():
        eager = op(x, ex.w13, ex.w2, weights, ids, "silu", 1.0, None)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            op(x, ex.w13, ex.w2, weights, ids, "silu", 1.0, None)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = op(x, ex.w13, ex.w2, weights, ids, "silu", 1.0, None)
        ids.copy_(routing("skewed", m, k, e, seed=2).cuda())  # other routing, other block count
        graph.replay()
        torch.testing.assert_close(out, op(x, ex.w13, ex.w2, weights, ids, "silu", 1.0, None), rtol=0, atol=0)
        assert not torch.equal(out, eager)


@pytest.mark.skipif(INTERPRET, reason="the GPU's FusedExperts")
def test_fused_experts_situ_matches_the_torch_path():
    """SiTU through FusedExperts on a k3-tiny-like config (bf16): the Triton path vs the torch path."""
    from service.config import PRESETS
    from service.model.moe import FusedExperts
    from service.parallel import TPGroup

    cfg = dataclasses.replace(PRESETS["k3-tiny"], n_routed_experts=32, moe_intermediate_size=96)
    ex = FusedExperts(cfg, 128, TPGroup.single(), torch.bfloat16).cuda()
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0, 128 ** -0.5)
    m = 48
    x = torch.randn(m, 128, device="cuda", dtype=torch.bfloat16)
    ids = routing("uniform", m, cfg.num_experts_per_tok, 32, seed=4).cuda()
    weights = torch.rand(m, cfg.num_experts_per_tok, device="cuda")
    with torch.inference_mode():
        got = ex(x, weights, ids)
        ref = ex.grouped(x, weights, ids)
    err = rel_error(got, ref)
    assert err < 1e-2, err
