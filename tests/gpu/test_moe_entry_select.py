"""The experts chosen inside the MoE entry kernel (LATENTSERVE_MOE_ENTRY_SELECT, moe_entry.py's
`_select_if_last`): at one row with the add-norm fold, the last router program to store its logits
runs moe_select's choice. Its weights and ids against latentserve::moe_route_select on the same
logits, its other outputs against moe_entry_add_norm's, the arrival counter left zeroed for the
next layer; a model's logits with the switch on and off; (CUDA only) decode graphs with it.

Runs on CUDA, or on a CPU with Triton installed and TRITON_INTERPRET=1 (kernels interpreted: its
programs run one after another, so the last router program is the last to arrive there).
"""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEVICE, GRAPH_SHAPES, INTERPRET, graph_steps, kernel_marks, require_kernel_device

require_kernel_device()

from _model_utils import build_model, full_logits  # noqa: E402

from service.config import PRESETS  # noqa: E402
from service.model import moe_entry, moe_select  # noqa: E402

pytestmark = kernel_marks(300)
EPS = 1e-6


def _inputs(k: int, experts: int, dtype: torch.dtype, seed: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    h, add = (torch.randn(1, k, generator=g) * 3).to(DEVICE, dtype), torch.randn(1, k, generator=g).to(DEVICE, dtype)
    norm = (1 + torch.randn(k, generator=g) / 4).to(DEVICE, dtype)
    down, shared, router = ((torch.randn(rows, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
                            for rows in (40, 48, experts))
    bias = (torch.randn(experts, generator=g) / 10).to(DEVICE)
    return h, add, norm, down, shared, router, bias


# (experts, n_group, topk_group, top_k, norm_topk_prob, scaling, softmax): small's grouped sigmoid
# choice (16 router programs), an ungrouped softmax over a count that is no power of 2 (5), a top-k
# that is none either.
CHOICES = [(64, 8, 4, 8, True, 2.5, False), (20, 1, 1, 4, False, 1.0, True), (16, 4, 2, 3, True, 1.0, False)]


@pytest.mark.parametrize("choice", CHOICES, ids=lambda c: f"{c[0]}e_top{c[3]}")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [96, 2100])
def test_entry_route_is_the_entry_then_the_selection(choice, dtype, k):
    experts, *rest = choice
    h, add, norm, down, shared, router, bias = _inputs(k, experts, dtype, seed=k + experts)
    counter = moe_entry.counter(h.device)
    assert counter is not None and int(counter.item()) == 0
    want = torch.ops.latentserve.moe_entry_add_norm(h, add, norm, EPS, down, shared, router, "silu", 1.0, None)
    for _ in range(2):  # the counter the first call left serves the second
        *got, weights, ids = torch.ops.latentserve.moe_entry_add_norm_route(
            h, add, norm, EPS, down, shared, router, "silu", 1.0, None, bias, *rest)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        want_weights, want_ids = torch.ops.latentserve.moe_route_select(got[2], bias, *rest)
        assert torch.equal(ids, want_ids) and torch.equal(weights, want_weights)
        assert int(counter.item()) == 0


def test_without_a_counter_the_selection_kernel_chooses(monkeypatch, spy):
    """Inside a capture that would have to make the counter, the op launches the selection kernel
    after the entry kernel: the same outputs."""
    experts, *rest = CHOICES[0]
    h, add, norm, down, shared, router, bias = _inputs(96, experts, torch.float32, seed=1)
    args = (h, add, norm, EPS, down, shared, router, "silu", 1.0, None, bias, *rest)
    want = torch.ops.latentserve.moe_entry_add_norm_route(*args)
    monkeypatch.setattr(moe_entry, "counter", lambda device: None)
    selects = spy(moe_select, "select")
    got = torch.ops.latentserve.moe_entry_add_norm_route(*args)
    assert len(selects) == 1 and all(torch.equal(a, b) for a, b in zip(got, want))


def test_off_by_default_and_one_row_only(monkeypatch):
    monkeypatch.delenv("LATENTSERVE_MOE_ENTRY_SELECT", raising=False)
    assert not moe_entry.select_enabled()
    monkeypatch.setenv("LATENTSERVE_MOE_ENTRY_SELECT", "1")
    assert moe_entry.select_enabled()
    h, add, norm, down, shared, router, bias = _inputs(96, 16, torch.float32, seed=0)
    two = torch.cat([h, h])
    with pytest.raises(ValueError, match="one row"):
        moe_entry._entry(two, down, shared, router, "silu", 1.0, None,
                         route=(bias, two, two, moe_entry.counter(h.device), 1.0, {}))


@pytest.mark.parametrize("tokens", [[5], [5, 9, 2]])
def test_tokens_through_the_model_give_the_same_logits(tokens, monkeypatch, spy):
    """`tiny` in fp32, cache-less, with the switch on against off: at one token every MoE layer
    chooses its experts in its entry kernel and no selection kernel runs; at three none does."""
    cfg = PRESETS["tiny"]
    model = build_model(cfg, device=DEVICE)
    monkeypatch.delenv("LATENTSERVE_MOE_ENTRY_SELECT", raising=False)
    ref = full_logits(model, tokens)
    monkeypatch.setenv("LATENTSERVE_MOE_ENTRY_SELECT", "1")
    routes = spy(torch.ops.latentserve, "moe_entry_add_norm_route")
    selects = spy(torch.ops.latentserve, "moe_route_select")
    got = full_logits(model, tokens)
    one = len(tokens) == 1
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    assert len(routes) == (moe_layers if one else 0)
    assert len(selects) == (0 if one else moe_layers)
    assert torch.equal(got, ref)


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs and compiled layers")
def test_decode_graphs_with_the_choice_in_the_entry_match_the_eager_step_without(monkeypatch):
    """`tiny` in bf16, graphs captured with the switch on at 1 and 4 sequences (the entry kernel
    chooses at 1; the selection kernel runs at 4), each replay against the eager step with it on
    and off; the counter zeroed after the replays."""
    steps = graph_steps(monkeypatch, "LATENTSERVE_MOE_ENTRY_SELECT", "1", GRAPH_SHAPES)
    for rows, step in steps.items():
        selects = [n for n in step.kernels if "_route_select_kernel" in n]
        assert bool(selects) == (rows != 1), (rows, sorted(set(selects)))
        graph_err, kernel_err = step.errors()
        assert graph_err < 3e-2 and kernel_err < 3e-2, (rows, graph_err, kernel_err)
    assert int(moe_entry.counter(torch.device(DEVICE)).item()) == 0
