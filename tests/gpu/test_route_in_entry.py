"""The expert selection inside the MoE entry kernel (LATENTSERVE_ROUTE_IN_ENTRY=N: up to N rows,
moe_select.choose_if_last, one selection a row block): the same experts and weights as the entry op
followed by the selection kernel, at one row with and without the add-norm fold and on 16- and
64-row blocks, the arrival counters zero again after; and a latent MoE layer's output unchanged
with the switch on, the selection's own launch gone.

Runs on CUDA, or on a CPU with Triton installed and TRITON_INTERPRET=1 (kernels interpreted: the
programs run in turn, so the last router program is the last to arrive).
"""

from __future__ import annotations

import pytest
import torch
from kernel_env import (
    DEVICE,
    GRAPH_SHAPES,
    INTERPRET,
    kernel_marks,
    replay_and_eager,
    require_kernel_device,
    skip_interpreted_16bit_dot,
)

require_kernel_device()

from service.model import moe_entry, moe_kernels, moe_select  # noqa: E402, F401 (the ops)

pytestmark = kernel_marks(300)
EPS = 1e-6


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("experts,n_group,topk_group,top_k,norm,softmax", [
    (64, 8, 4, 6, True, False), (48, 1, 1, 8, False, True), (20, 1, 1, 4, True, False)])
@pytest.mark.parametrize("rows,fold", [(1, False), (1, True), (5, False), (70, False)])
def test_selection_in_the_entry_kernel_is_the_selection_kernels(dtype, experts, n_group, topk_group, top_k, norm,
                                                                softmax, rows, fold):
    if rows > 1:
        skip_interpreted_16bit_dot(dtype)
    g = torch.Generator().manual_seed(experts + top_k)
    k = 300
    x, add = (torch.randn(rows, k, generator=g).to(DEVICE, dtype) for _ in range(2))
    norm_w = (1 + torch.randn(k, generator=g) / 4).to(DEVICE, dtype)
    down, shared, router = ((torch.randn(rows, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
                            for rows in (40, 48, experts))
    bias = (torch.randn(experts, generator=g) * 0.1).to(DEVICE)
    ops, weights, route = torch.ops.latentserve, (down, shared, router), (n_group, topk_group, top_k, norm, 2.5, softmax)
    if fold:
        lat, h, logits, total = ops.moe_entry_add_norm(x, add, norm_w, EPS, *weights, "silu", 1.0, None)
    else:
        lat, h, logits = ops.moe_entry(x, *weights, "silu", 1.0, None)
    want_w, want_ids = ops.moe_route_select(logits, bias, *route)
    got = ops.moe_entry_select(x, add if fold else None, norm_w if fold else None, EPS, *weights, "silu", 1.0, None,
                               bias, *route)
    assert torch.equal(got[0], lat) and torch.equal(got[1], h)
    assert torch.equal(got[3], want_ids)
    # the normalization's sum over the k weights may add in another order on 4 warps than on one
    torch.testing.assert_close(got[2], want_w, atol=0, rtol=1e-6)
    assert torch.equal(got[4], total) if fold else got[4].numel() == 0
    assert not moe_select.arrival_counters(x.device, 2).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_latent_moe_layer_with_the_selection_in_the_entry_kernel(dtype, monkeypatch, spy):
    """k3-tiny's latent MoE at one token: the same output, one entry launch and no selection launch;
    at two tokens the switch at 1 changes nothing (the entry's rows kernel, then the selection), and
    at 16 the rows kernel selects too."""
    from test_moe_entry import latent_moe_layer

    skip_interpreted_16bit_dot(dtype)
    layer, x = latent_moe_layer("k3-tiny", dtype)
    with torch.no_grad():
        monkeypatch.delenv("LATENTSERVE_ROUTE_IN_ENTRY", raising=False)
        want = layer(x[:1]), layer(torch.cat([x[:1], x[:1]]))
        monkeypatch.setenv("LATENTSERVE_ROUTE_IN_ENTRY", "1")
        fused, selects = spy(torch.ops.latentserve, "moe_entry_select"), spy(torch.ops.latentserve, "moe_route_select")
        got = layer(x[:1])
        assert (len(fused), len(selects)) == (1, 0)
        two = layer(torch.cat([x[:1], x[:1]]))
        assert (len(fused), len(selects)) == (1, 1)
        monkeypatch.setenv("LATENTSERVE_ROUTE_IN_ENTRY", "16")
        two_in_entry = layer(torch.cat([x[:1], x[:1]]))
        assert (len(fused), len(selects)) == (2, 1)
    tol = dict(atol=0, rtol=0) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(got, want[0], **tol)
    torch.testing.assert_close(two, want[1], **tol)
    torch.testing.assert_close(two_in_entry, want[1], **tol)
    assert moe_select.GUARD.failure is None


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs and compiled layers")
@pytest.mark.parametrize("max_rows", [1, 16])
def test_decode_graphs_with_the_selection_in_the_entry_kernel(monkeypatch, max_rows):
    """`tiny` in bf16, graphs captured with the switch at `max_rows`, at 1 and 4 sequences: no
    selection kernel in a replay of up to max_rows, and each replay (a few, the counters reused)
    against the eager step with it off."""
    from service import LLM

    monkeypatch.setenv("LATENTSERVE_ROUTE_IN_ENTRY", str(max_rows))
    llm = LLM(model="tiny", hf_overrides=GRAPH_SHAPES, dtype="bfloat16", device=DEVICE, seed=0,
              distributed_executor_backend="uni", max_num_seqs=4, cuda_graph_batch_sizes=[1, 4])
    steps = {}
    try:
        worker = llm.executor.rank0
        with torch.inference_mode():
            for kv in worker.kv_caches:
                kv.normal_()
        for i, rows in enumerate((1, 4, 1, 4)):
            steps[i] = rows, *replay_and_eager(worker, rows, monkeypatch, "LATENTSERVE_ROUTE_IN_ENTRY", str(max_rows))
    finally:
        llm.shutdown()
        torch._dynamo.reset()
    assert moe_select.GUARD.failure is None
    for rows, out, ref, names in steps.values():
        assert any("_route_select_kernel" in n for n in names) == (rows > max_rows), rows
        rel = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
        assert rel < 3e-2, (rows, rel)  # bf16, as test_add_norm's graph against eager
    assert not moe_select.arrival_counters(torch.device(DEVICE, 0), 1).any()
