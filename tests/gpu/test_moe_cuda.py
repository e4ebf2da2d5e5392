"""The CUDA C routed experts for a few tokens (service/model/moe_cuda.py) against float64 and
against moe_kernels.py's Triton kernels they stand in for: SiLU and SiTU (with and without the up
clip), 1-32 (token, slot) pairs, widths that end mid-chunk and mid-block, the `small` preset's
shapes, CUDA graphs, and the engine's decode graphs against its eager step. Needs a GPU."""

from __future__ import annotations

import pytest
import torch
from kernel_env import GRAPH_SHAPES, graph_steps, record_calls, require_cuda_c

require_cuda_c()

from test_moe_kernels import reference, situ  # noqa: E402

from service.model import moe_cuda  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
SWITCH = "LATENTSERVE_MOE_CUDA_MAX_PAIRS"


def case(m: int, top_k: int, experts: int, width: int, shard: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, width, generator=g).cuda().bfloat16()
    w13 = (torch.randn(experts, 2 * shard, width, generator=g) / width ** 0.5).cuda().bfloat16()
    w2 = (torch.randn(experts, width, shard, generator=g) / shard ** 0.5).cuda().bfloat16()
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(m)]).cuda()
    weights = torch.rand(m, top_k, generator=g).cuda()
    return x, w13, w2, weights, ids


def act_fn(act: str, beta: float, linear_beta: float | None):
    return (lambda a, b: torch.nn.functional.silu(a) * b) if act == "silu" else situ(beta, linear_beta)


@pytest.mark.parametrize("act,beta,linear_beta", [("silu", 1.0, None), ("situ", 4.0, 8.0), ("situ", 2.0, None)])
@pytest.mark.parametrize("m,top_k,experts,width,shard", [
    (1, 8, 64, 1024, 768),  # the small preset at one token
    (4, 8, 64, 1024, 768),  # 32 pairs, four tokens
    (3, 4, 12, 168, 48),  # widths that end mid-chunk (168 = 5 x 32 + 8) and mid-block
    (2, 6, 10, 104, 40),
])
def test_matches_float64_and_the_triton_kernels(monkeypatch, act, beta, linear_beta, m, top_k, experts, width, shard):
    x, w13, w2, weights, ids = case(m, top_k, experts, width, shard, seed=m * 100 + width)
    monkeypatch.setenv(SWITCH, "0")
    triton_out = torch.ops.latentserve.moe_experts(x, w13, w2, weights, ids, act, beta, linear_beta)
    monkeypatch.setenv(SWITCH, "32")
    calls = record_calls(monkeypatch, moe_cuda, "run")
    out = torch.ops.latentserve.moe_experts(x, w13, w2, weights, ids, act, beta, linear_beta)
    assert calls == [True], moe_cuda.GUARD.failure
    ref = reference(x.float().cpu(), w13.float().cpu(), w2.float().cpu(), weights.cpu(), ids.cpu(),
                    act_fn(act, beta, linear_beta))
    scale = ref.abs().max().item()
    assert (out.double().cpu() - ref).abs().max().item() < 2e-2 * scale
    # The same roundings in a different order of fp32 sums: within a few bf16 steps of the output.
    assert (out.float() - triton_out.float()).abs().max().item() < 2e-2 * scale


def test_unweighted_parts_and_pairs_above_the_switch(monkeypatch):
    """experts_parts (the latent MoE's unsummed slots) equal; 5 pairs with the switch at 4: Triton's."""
    x, w13, w2, weights, ids = case(1, 5, 16, 256, 64, seed=3)
    monkeypatch.setenv(SWITCH, "0")
    ref = torch.ops.latentserve.moe_experts_parts(x, w13, w2, weights, ids, "silu", 1.0, None)
    monkeypatch.setenv(SWITCH, "8")
    calls = record_calls(monkeypatch, moe_cuda, "run")
    got = torch.ops.latentserve.moe_experts_parts(x, w13, w2, weights, ids, "silu", 1.0, None)
    assert calls == [True] and got.shape == ref.shape == (5, 256)
    assert (got - ref).abs().max().item() < 2e-2 * ref.abs().max().item()
    monkeypatch.setenv(SWITCH, "4")
    torch.ops.latentserve.moe_experts_parts(x, w13, w2, weights, ids, "silu", 1.0, None)
    assert calls == [True]


def test_graph_replay_follows_new_routing(monkeypatch):
    """Captured once, replayed after x, the expert ids and weights change in place."""
    monkeypatch.setenv(SWITCH, "32")
    x, w13, w2, weights, ids = case(2, 8, 64, 1024, 768, seed=5)
    torch.ops.latentserve.moe_experts(x, w13, w2, weights, ids, "silu", 1.0, None)  # builds the kernels first
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.latentserve.moe_experts(x, w13, w2, weights, ids, "silu", 1.0, None)
    x2, _, _, weights2, ids2 = case(2, 8, 64, 1024, 768, seed=6)
    x.copy_(x2)
    ids.copy_(ids2)
    weights.copy_(weights2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, torch.ops.latentserve.moe_experts(x, w13, w2, weights, ids, "silu", 1.0, None))
    assert moe_cuda.GUARD.failure is None


def test_decode_graphs_with_the_kernels_match_the_eager_step_without(monkeypatch):
    """`tiny` in bf16: decode graphs captured with the kernels on at 1 and 4 sequences, each replay
    against the eager step with them on and off."""
    steps = graph_steps(monkeypatch, SWITCH, "32", GRAPH_SHAPES)
    assert moe_cuda.GUARD.failure is None
    for rows, step in steps.items():
        assert any("expert_gate_up_small" in n for n in step.kernels), (rows, sorted(set(step.kernels)))
        graph_err, kernel_err = step.errors()  # against the eager step with the switch on, and off
        assert graph_err < 3e-2 and kernel_err < 3e-2, (rows, graph_err, kernel_err)
