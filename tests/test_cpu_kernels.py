"""The CPU C kernels (service/model/cpu_kernels.py) against the torch paths they replace: MLA
decode over padded, scattered cache slots, and SiLU experts over skewed routing, to fp32
rounding; what they decline (other dtypes, non-contiguous inputs, disabled) returns None, so the
callers keep their torch path."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from service.model import cpu_kernels

pytestmark = pytest.mark.skipif(cpu_kernels.library() is None, reason="no C compiler: the torch paths run")


def _torch_decode(q, cache, slots, lens, kv_lora, scale):
    b, width = slots.shape
    inside = torch.arange(width)[None] < lens[:, None]
    bias = torch.zeros(b, 1, width).masked_fill_(~inside[:, None], float("-inf"))
    ctx = cache.index_select(0, slots.reshape(-1)).view(b, width, -1)
    scores = torch.baddbmm(bias, q, ctx.transpose(1, 2), alpha=scale)
    return torch.bmm(scores.softmax(-1), ctx[..., :kv_lora])


@pytest.mark.parametrize("batch,heads,width", [(1, 1, 1), (5, 2, 9), (16, 4, 33), (7, 3, 70)])
def test_mla_decode_matches_the_gathered_torch_path(batch, heads, width):
    g = torch.Generator().manual_seed(batch * 100 + width)
    dim, kv_lora = 96, 64
    cache = torch.randn(50, 16, dim, generator=g).view(-1, dim)
    lens = torch.randint(1, width + 1, (batch,), generator=g)
    lens[0] = width
    slots = torch.stack([torch.randperm(cache.shape[0], generator=g)[:width] for _ in range(batch)])
    slots = torch.where(torch.arange(width)[None] < lens[:, None], slots, slots[:, :1])  # padding: slot 0
    q = torch.randn(batch, heads, dim, generator=g)
    out = cpu_kernels.mla_decode(q, cache, slots, lens, kv_lora, 0.125)
    want = _torch_decode(q, cache, slots, lens, kv_lora, 0.125)
    assert out.shape == (batch, heads, kv_lora)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def _torch_experts(x, w13, w2, weights, ids):
    inter = w13.shape[1] // 2
    out = torch.zeros(x.shape[0], w2.shape[1])
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            gate_up = F.linear(x[t], w13[ids[t, j]])
            out[t] += weights[t, j] * F.linear(F.silu(gate_up[:inter]) * gate_up[inter:], w2[ids[t, j]])
    return out


@pytest.mark.parametrize("tokens,experts,k", [(1, 8, 2), (16, 8, 2), (33, 16, 4)])
def test_silu_experts_match_the_per_token_reference(tokens, experts, k):
    g = torch.Generator().manual_seed(tokens * 7 + experts)
    width, inter = 48, 40
    x = torch.randn(tokens, width, generator=g)
    w13 = torch.randn(experts, 2 * inter, width, generator=g) * 0.1
    w2 = torch.randn(experts, width, inter, generator=g) * 0.1
    logits = torch.randn(tokens, experts, generator=g)
    logits[:, 0] += 5.0  # skewed: every token takes expert 0
    weights, ids = logits.sigmoid().topk(k, dim=-1)
    out = cpu_kernels.moe_silu(x, w13, w2, weights, ids)
    torch.testing.assert_close(out, _torch_experts(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-6)


def test_what_the_kernels_decline_returns_none(monkeypatch):
    q, cache = torch.randn(2, 1, 8), torch.randn(10, 8)
    slots, lens = torch.zeros(2, 3, dtype=torch.long), torch.tensor([3, 1])
    assert cpu_kernels.mla_decode(q.to(torch.bfloat16), cache.to(torch.bfloat16), slots, lens, 4, 1.0) is None
    assert cpu_kernels.mla_decode(torch.randn(2, 1, 16)[..., ::2], cache, slots, lens, 4, 1.0) is None
    x, w13, w2 = torch.randn(2, 8), torch.randn(3, 8, 8), torch.randn(3, 8, 4)
    weights, ids = torch.rand(2, 1), torch.zeros(2, 1, dtype=torch.long)
    assert cpu_kernels.moe_silu(x.to(torch.bfloat16), w13, w2, weights, ids) is None
    assert cpu_kernels.moe_silu(x, w13, w2, weights, ids) is not None
    monkeypatch.setenv("LATENTSERVE_CPU_KERNELS", "0")
    assert cpu_kernels.mla_decode(q, cache, slots, lens, 4, 1.0) is None
    assert cpu_kernels.moe_silu(x, w13, w2, weights, ids) is None
