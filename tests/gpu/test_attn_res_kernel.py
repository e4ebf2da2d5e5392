"""Kimi-K3's attention-residual mix as one Triton kernel (attn_res.mix_kernel) against the torch
chain it replaces (`attn_res._mix`): the new running sum, the bank row it closes, the sublayer
input, for no sources to several, with and without the last output to add and the input norm,
a width that is not a power of two. Runs on CUDA, or on a CPU with Triton installed and
TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEVICE, INTERPRET, kernel_marks, require_kernel_device

require_kernel_device()

from service.model import attn_res  # noqa: E402

pytestmark = kernel_marks(120)


def draw(t: int, h: int, blocks: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0, shift=0.0):
        return (shift + scale * torch.randn(*shape, generator=g)).to(DEVICE, dtype)

    # Sources of different scales, so the softmax weights are far from uniform.
    bank = randn(t, blocks, h) * torch.tensor([1.0, 4.0, 0.3, 2.0, 1.5][:blocks]).view(1, -1, 1).to(DEVICE, dtype)
    return (randn(t, h), randn(t, h, scale=0.5), bank, randn(h, scale=0.2, shift=1.0), randn(1, h, scale=0.3),
            randn(h, scale=0.2, shift=1.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("t,h", [(1, 256), (5, 96)])
@pytest.mark.parametrize("num_blocks,write_block,delta,out_norm", [
    (0, 0, True, True),  # layer 0's enter: the embeddings close block 0, one source
    (2, -1, True, True),  # a layer inside a block
    (3, 3, True, True),  # a block's first layer: it closes block 3, the sources before it
    (2, 1, False, True),  # a written row among the sources (read back as the prefix)
    (4, -1, True, False),  # the final mix: every block, no input norm
])
def test_mix_kernel_matches_the_torch_chain(dtype, t, h, num_blocks, write_block, delta, out_norm):
    prefix, d, bank, norm_w, proj_w, out_w = draw(t, h, 5, dtype, seed=t * h + num_blocks)
    args = (prefix, d if delta else None)
    rest = (num_blocks, norm_w, 1e-6, proj_w, out_w if out_norm else None, 1e-5, write_block)
    ref_bank, got_bank = bank.clone(), bank.clone()
    ref_prefix, ref_out = attn_res._mix.eager(*args, ref_bank, *rest)
    got_prefix, got_out = torch.ops.latentserve.attn_res_mix(*args, got_bank, *rest)
    assert got_out.dtype == dtype and got_out.shape == (t, h)
    # fp32: sum orders; bf16: the interpreter rounds fp32 -> bf16 by truncation (a GPU to nearest).
    exact = dtype == torch.float32 or not INTERPRET
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(got_prefix, ref_prefix, atol=0 if exact else tol, rtol=0 if exact else tol)
    torch.testing.assert_close(got_bank, ref_bank, atol=0 if exact else tol, rtol=0 if exact else tol)
    torch.testing.assert_close(got_out.float(), ref_out.float(), atol=tol * ref_out.float().abs().max(), rtol=tol)


def test_mix_kernel_refuses_a_bank_that_does_not_fit():
    prefix, d, bank, norm_w, proj_w, out_w = draw(2, 64, 3, torch.float32, seed=0)
    with pytest.raises(ValueError, match="4 sources do not fit"):
        torch.ops.latentserve.attn_res_mix(prefix, d, bank, 4, norm_w, 1e-6, proj_w, out_w, 1e-5, -1)


def test_layers_mix_through_the_kernel_when_switched_on(monkeypatch, spy):
    """attn_res_mix (what DecoderLayer calls) takes the kernel with LATENTSERVE_ATTN_RES_KERNEL=1."""
    from service.model.layers import ReplicatedLinear, RMSNorm

    h = 64
    norm, out_norm, proj = RMSNorm(h, 1e-6, torch.float32), RMSNorm(h, 1e-6, torch.float32), ReplicatedLinear(h, 1, torch.float32)
    prefix, d, bank, norm_w, proj_w, out_w = draw(3, h, 3, torch.float32, seed=1)
    with torch.no_grad():
        norm.weight.copy_(norm_w.cpu()), out_norm.weight.copy_(out_w.cpu()), proj.weight.copy_(proj_w.cpu())
    norm, out_norm, proj = norm.to(DEVICE), out_norm.to(DEVICE), proj.to(DEVICE)
    monkeypatch.setenv("LATENTSERVE_ATTN_RES_KERNEL", "0")  # the torch chain
    ref = attn_res.attn_res_mix(prefix, d, bank.clone(), 2, norm, proj, out_norm)
    monkeypatch.setenv("LATENTSERVE_ATTN_RES_KERNEL", "1")
    calls = spy(attn_res, "mix_kernel")
    got = attn_res.attn_res_mix(prefix, d, bank.clone(), 2, norm, proj, out_norm)
    assert len(calls) == 1
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
