"""The opaque cuBLAS products (service/model/dense_mm.py): their math against float64, and the
reason they exist, checked on Inductor's CPU code: `h + x @ W.T` compiles to `addmm` through
F.linear and to no `addmm` through `mm_t`, whose add then stands alone (or joins the next kernel)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch._inductor.utils import run_and_get_code

from service.model import dense_mm


def _ref(*pairs):
    return sum(x.double() @ w.double().t() for x, w in pairs)


def test_products_match_float64():
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 5, 48, generator=g), torch.randn(40, 48, generator=g)
    x2, w2 = torch.randn(3, 5, 24, generator=g), torch.randn(40, 24, generator=g)
    inputs = [t.clone() for t in (x, w, x2, w2)]
    out = torch.ops.latentserve.mm_t(x, w)
    assert out.shape == (3, 5, 40)
    torch.testing.assert_close(out.double(), _ref((x, w)), rtol=1e-5, atol=1e-4)
    both = torch.ops.latentserve.mm_t_sum(x, w, x2, w2)
    assert both.shape == (3, 5, 40)
    torch.testing.assert_close(both.double(), _ref((x, w), (x2, w2)), rtol=1e-5, atol=1e-4)
    # inputs untouched: the accumulation is into a fresh output
    assert all(torch.equal(a, b) for a, b in zip((x, w, x2, w2), inputs, strict=True))


def test_a_residual_add_does_not_become_addmm():
    g = torch.Generator().manual_seed(1)
    h, x, w = torch.randn(16, 64, generator=g), torch.randn(16, 32, generator=g), torch.randn(64, 32, generator=g)

    def folded(h, x, w):
        return h + F.linear(x, w)

    def opaque(h, x, w):
        return h + torch.ops.latentserve.mm_t(x, w)

    torch._dynamo.reset()
    out, (code,) = run_and_get_code(torch.compile(folded, fullgraph=True), h, x, w)
    assert "addmm" in code  # the premise: Inductor folds the add into cuBLAS's/MKL's addmm
    torch._dynamo.reset()
    out2, (code2,) = run_and_get_code(torch.compile(opaque, fullgraph=True), h, x, w)
    assert "addmm" not in code2 and "mm_t" in code2
    torch.testing.assert_close(out2, out, rtol=1e-5, atol=1e-5)


def test_off_without_cuda(monkeypatch):
    monkeypatch.setenv("LATENTSERVE_OPAQUE_MM", "1")
    assert not dense_mm.enabled(torch.zeros(1))  # CPU tensors keep F.linear
