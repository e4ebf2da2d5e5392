"""Routed experts through torch._grouped_mm against the per-expert loop, empty experts included.

On CUDA (bf16, sm_90) this is the serving path; on a CPU whose torch has _grouped_mm the same
permutation, offsets and un-permutation logic runs through torch's CPU grouped GEMM.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_env import rel_error

from service.config import PRESETS
from service.model.moe import FusedExperts, grouped_mm_fast
from service.parallel import TPGroup

pytestmark = pytest.mark.gpu
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def experts(num: int, width: int, inter: int, dtype, seed: int) -> FusedExperts:
    g = torch.Generator().manual_seed(seed)
    cfg = dataclasses.replace(PRESETS["tiny"], n_routed_experts=num, moe_intermediate_size=inter)
    ex = FusedExperts(cfg, width, TPGroup.single(), dtype)
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * width ** -0.5)
    return ex.to(DEVICE)


def routing(m: int, k: int, num: int, active: int, seed: int):
    """Top-k ids drawn from the first `active` experts only, so the others get no tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(active, generator=g)[:k] for _ in range(m)])
    weights = torch.rand(m, k, generator=g) + 0.1
    return weights.to(DEVICE), ids.to(DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m,active", [(1, 64), (7, 12), (64, 64), (33, 9)])
def test_grouped_matches_per_expert(dtype, m, active):
    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    if DEVICE == "cuda" and dtype != torch.bfloat16:
        pytest.skip("CUDA grouped GEMM is bf16-only (fp32 serves through the loop)")
    ex = experts(64, 128, 96, dtype, seed=m)
    x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m + 1)).to(DEVICE, dtype)
    weights, ids = routing(m, 8, 64, active, seed=m + 2)
    with torch.inference_mode():
        ref = ex.per_expert(x, weights, ids).double()
        out = ex.grouped(x, weights, ids)
    assert out.dtype == dtype and out.shape == (m, 128)
    err = rel_error(out, ref)
    assert err < (1e-2 if dtype == torch.bfloat16 else 1e-5), f"relative error {err:.2e}"


@pytest.mark.skipif(DEVICE != "cuda", reason="the grouped path is chosen on CUDA only")
def test_cuda_bf16_takes_the_grouped_path():
    x = torch.zeros(1, 8, device="cuda", dtype=torch.bfloat16)
    assert grouped_mm_fast(x) == (torch.cuda.get_device_capability()[0] in (9, 10))
    assert not grouped_mm_fast(x.float())


@pytest.mark.skipif(DEVICE != "cuda", reason="CUDA graphs")
def test_grouped_path_captures_in_a_cuda_graph():
    ex = experts(64, 128, 96, torch.bfloat16, seed=5)
    x = torch.randn(16, 128, device="cuda", dtype=torch.bfloat16)
    weights, ids = routing(16, 8, 64, 20, seed=6)
    with torch.inference_mode():
        eager = ex.grouped(x, weights, ids)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            ex.grouped(x, weights, ids)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = ex.grouped(x, weights, ids)
        new_w, new_ids = routing(16, 8, 64, 64, seed=7)  # other routing, same buffers
        weights.copy_(new_w)
        ids.copy_(new_ids)
        graph.replay()
        torch.testing.assert_close(out, ex.grouped(x, weights, ids), rtol=0, atol=0)
        assert not torch.equal(out, eager)


@pytest.mark.skipif(DEVICE != "cuda", reason="the Triton expert kernels run on CUDA")
@pytest.mark.parametrize("m,kernel", [(4, "moe_experts"), (5, "moe_grouped_experts"), (8, "moe_grouped_experts")])
def test_bf16_experts_take_the_grouped_gemm_from_5_tokens(m, kernel, spy):
    """FusedExperts in bf16: the GEMV experts up to 4 tokens, the grouped GEMM from 5 (each
    chosen expert's weights read once for all its tokens); same output as that op called alone."""
    ex = experts(64, 128, 96, torch.bfloat16, seed=m)
    x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m)).to(DEVICE, torch.bfloat16)
    weights, ids = routing(m, 8, 64, 16, seed=m + 1)  # 16 experts: tokens share them
    op = getattr(torch.ops.latentserve, kernel)
    calls = spy(torch.ops.latentserve, kernel)
    with torch.inference_mode():
        out = ex(x, weights, ids)
        ref = op(x, ex.w13, ex.w2, weights, ids, ex.act_name, ex.act_beta, ex.act_linear_beta)
        per_expert = ex.per_expert(x, weights, ids).double()
    assert calls == [kernel]
    assert torch.equal(out, ref)
    assert rel_error(out, per_expert) < 1e-2
