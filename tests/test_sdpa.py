"""model/sdpa.py on the CPU: the plan budget's accounting and causal attention with v narrower
than q and k (MLA's expanded prefill) against an explicit softmax."""

from __future__ import annotations

import torch

from service.model import sdpa


def test_a_shape_is_ready_once_its_work_reaches_the_budget():
    plans = sdpa.PlanBudget()
    a, b = (8, 16, 1024, 192, 128, torch.bfloat16), (7, 16, 1024, 192, 128, torch.bfloat16)
    assert [plans.ready(a, 4.0, 10.0) for _ in range(4)] == [False, False, False, True]
    assert not plans.ready(b, 4.0, 10.0)  # shapes count apart
    assert plans.ready(b, 4.0, 0.0)  # "always"
    assert not plans.ready(("other",), 1e30, float("inf"))  # "never"


def test_the_budget_forgets_the_least_worked_shapes_when_full():
    plans = sdpa.PlanBudget(max_shapes=4)
    plans.ready(("big",), 100.0, 100.0)  # planned on its next call
    for i in range(3):
        plans.ready(("small", i), float(i + 1), 100.0)
    plans.ready(("new",), 50.0, 100.0)  # full: the two least-worked shapes go
    assert set(plans.work) == {("big",), ("small", 2), ("new",)}
    assert plans.ready(("big",), 1.0, 100.0)


def test_plan_budget_modes(monkeypatch):
    monkeypatch.setenv("LATENTSERVE_SDPA_CUDNN", "never")
    assert sdpa._plan_after() == float("inf")
    monkeypatch.setenv("LATENTSERVE_SDPA_CUDNN", "always")
    assert sdpa._plan_after() == 0.0
    monkeypatch.delenv("LATENTSERVE_SDPA_CUDNN")
    assert sdpa._plan_after() == sdpa.PLAN_AFTER


def test_causal_with_narrow_v_matches_softmax():
    torch.manual_seed(0)
    b, h, n = 2, 3, 17
    q, k = torch.randn(b, h, n, 12), torch.randn(b, h, n, 12)
    v = torch.randn(b, h, n, 8)
    out = sdpa.causal(q, k, v, 0.3)
    scores = (q @ k.transpose(-1, -2)) * 0.3
    scores = scores.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
    assert out.shape == (b, h, n, 8)
    torch.testing.assert_close(out, scores.softmax(-1) @ v, atol=1e-5, rtol=1e-5)


def test_masked_matches_softmax():
    """A prompt's later chunk: queries at positions 5.. over 5 cached keys and their own."""
    torch.manual_seed(1)
    h, n, start = 2, 4, 5
    q, k, v = torch.randn(1, h, n, 12), torch.randn(1, h, start + n, 12), torch.randn(1, h, start + n, 8)
    mask = torch.arange(start + n)[None, :] <= (start + torch.arange(n))[:, None]
    out = sdpa.masked(q, k, v, mask, 0.3)
    scores = ((q @ k.transpose(-1, -2)) * 0.3).masked_fill(~mask, float("-inf"))
    torch.testing.assert_close(out, scores.softmax(-1) @ v, atol=1e-5, rtol=1e-5)
