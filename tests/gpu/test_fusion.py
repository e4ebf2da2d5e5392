"""The torch.compile'd elementwise chains (service/model/fusion.py) equal their eager functions
on CUDA at every batch size a decode graph uses, and replay inside a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from service.model.layers import apply_rope, rms_norm_hf
from service.model.moe import route
from service.tail.base import rms_norm

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = "cuda"
BF16 = torch.bfloat16


def _close(a, b, tol):
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.allclose(a.float(), b.float(), atol=tol, rtol=tol), (a.float() - b.float()).abs().max().item()


@pytest.mark.parametrize("m", [1, 5, 64])
def test_norms_and_rope_match_eager(m):
    g = torch.Generator(device=DEV).manual_seed(m)
    for width in (512, 2048):
        x = torch.randn(m, width, device=DEV, generator=g).to(BF16)
        w = (torch.rand(width, device=DEV, generator=g) + 0.5).to(BF16)
        _close(rms_norm_hf(x, w, 1e-6), rms_norm_hf.eager(x, w, 1e-6), 1e-2)
        _close(rms_norm(x, w, 1e-6), rms_norm.eager(x, w, 1e-6), 1e-2)
        _close(rms_norm(x, None, 1e-6), rms_norm.eager(x, None, 1e-6), 1e-2)
    q = torch.randn(m, 16, 64, device=DEV, generator=g).to(BF16)
    k = torch.randn(m, 64, device=DEV, generator=g).to(BF16)
    ang = torch.rand(m, 32, device=DEV, generator=g) * 6.28
    # eager rope rounds each product to bf16, the fused kernel once at the end: 2 ulps apart
    for inter in (True, False):
        _close(apply_rope(q, ang.cos(), ang.sin(), inter), apply_rope.eager(q, ang.cos(), ang.sin(), inter), 2e-2)
        _close(apply_rope(k, ang.cos(), ang.sin(), inter), apply_rope.eager(k, ang.cos(), ang.sin(), inter), 2e-2)


@pytest.mark.parametrize("m", [1, 8, 64])
def test_router_matches_eager(m):
    g = torch.Generator(device=DEV).manual_seed(10 + m)
    x = torch.randn(m, 1024, device=DEV, generator=g).to(BF16)
    weight = (torch.randn(64, 1024, device=DEV, generator=g) * 0.05).to(BF16)
    bias = torch.randn(64, device=DEV, generator=g) * 0.01
    for n_group, topk_group in ((1, 1), (8, 4)):
        args = (weight, bias, n_group, topk_group, 6, True, 2.5)
        (w1, i1), (w2, i2) = route(x, *args), route.eager(x, *args)
        # top-k without sorting may list the same experts in another order: compare by expert id
        o1, o2 = i1.sort(-1), i2.sort(-1)
        assert torch.equal(o1.values, o2.values)
        _close(w1.gather(1, o1.indices), w2.gather(1, o2.indices), 1e-5)


def test_compiled_chain_replays_in_a_cuda_graph():
    x = torch.randn(8, 2048, device=DEV).to(BF16)
    w = torch.ones(2048, device=DEV, dtype=BF16)
    ref = rms_norm_hf.eager(x, w, 1e-6)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        rms_norm_hf(x, w, 1e-6)  # compile outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = rms_norm_hf(x, w, 1e-6)
    x.add_(1.0)  # new input in the same buffer: the replay must read it
    graph.replay()
    torch.cuda.synchronize()
    _close(out, rms_norm_hf.eager(x, w, 1e-6), 1e-2)
    assert not torch.allclose(out.float(), ref.float(), atol=1e-2)
