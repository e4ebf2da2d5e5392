"""MLA decode's absorbed projections as Triton kernels (model/mla_absorb.py) against float64, on
the strided views the attention passes them; the attention kernel with q_latent and q_pe as two
inputs equals it with their cat; and the absorbed decode through the kernels equals the bmm path.

Runs on CUDA, or on a CPU with Triton installed and TRITON_INTERPRET=1 (kernels interpreted).
"""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEVICE, INTERPRET, kernel_marks, require_kernel_device

require_kernel_device()

from test_mla_decode_kernel import case  # noqa: E402

from service.model import mla_absorb, mla_decode  # noqa: E402

pytestmark = kernel_marks(300)
DTYPES = [(torch.float32, 1e-5)] + ([] if INTERPRET else [(torch.bfloat16, 1e-2)])


def kv_b(heads, nope, v, lora, dtype, seed=0):
    """kv_b_proj's weight viewed per head, and its W_UK / W_UV slices (views, as attention.py takes them)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(heads * (nope + v), lora, generator=g) * lora ** -0.5).to(DEVICE, dtype)
    w = w.view(heads, nope + v, lora)
    return w, w[:, :nope], w[:, nope:]


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("batch,heads", [(1, 16), (5, 4), (40, 8)])
def test_absorb_q_matches_float64(dtype, tol, batch, heads):
    nope, rope, v, lora = 32, 16, 32, 64
    w, w_uk, _ = kv_b(heads, nope, v, lora, dtype)
    q = torch.randn(batch, heads, nope + rope, generator=torch.Generator().manual_seed(batch)).to(DEVICE, dtype)
    assert mla_absorb.supported(q, w)
    out = torch.ops.latentserve.mla_absorb_q(q[..., :nope], w_uk)  # a strided view, as the attention passes
    ref = torch.einsum("bhn,hnd->bhd", q[..., :nope].cpu().double(), w_uk.cpu().double())
    assert out.shape == (batch, heads, lora) and out.dtype == dtype
    err = ((out.cpu().double() - ref).norm() / ref.norm()).item()
    assert err < tol, f"relative error {err:.2e}"


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("batch,heads", [(1, 16), (5, 4), (40, 8)])
def test_absorb_out_matches_float64(dtype, tol, batch, heads):
    nope, v, lora = 32, 48, 64
    _, _, w_uv = kv_b(heads, nope, v, lora, dtype)
    o = torch.randn(batch, heads, lora, generator=torch.Generator().manual_seed(batch)).to(DEVICE)  # fp32
    out = torch.ops.latentserve.mla_absorb_out(o, w_uv)
    # The torch path's rounding: the fp32 attention output cast to the model dtype first.
    ref = torch.einsum("bhd,hvd->bhv", o.to(dtype).cpu().double(), w_uv.cpu().double()).reshape(batch, heads * v)
    assert out.shape == (batch, heads * v) and out.dtype == dtype and out.is_contiguous()
    err = ((out.cpu().double() - ref).norm() / ref.norm()).item()
    assert err < tol, f"relative error {err:.2e}"


def test_empty_batch():
    w, w_uk, w_uv = kv_b(4, 32, 32, 64, torch.float32)
    assert torch.ops.latentserve.mla_absorb_q(torch.empty(0, 4, 32, device=DEVICE), w_uk).shape == (0, 4, 64)
    assert torch.ops.latentserve.mla_absorb_out(torch.empty(0, 4, 64, device=DEVICE), w_uv).shape == (0, 128)


@pytest.mark.parametrize("splits", [None, 1])
def test_decode_with_separate_rope_query_equals_the_cat(splits):
    lora, rope, block_size = 64, 16, 4
    q, kv, tables, ctx, _ = case(11, 3, 8, lora, rope, block_size, torch.float32, 40)
    scale = (lora + rope) ** -0.5
    whole = mla_decode.mla_decode(q, kv, tables, ctx, lora, scale, splits=splits)
    wide = torch.randn(3, 8, 96, device=DEVICE)  # q_pe as a strided view of a wider row
    wide[..., 80:] = q[..., lora:]
    parts = mla_decode.mla_decode(q[..., :lora].contiguous(), kv, tables, ctx, lora, scale, splits=splits,
                                  q_pe=wide[..., 80:])
    assert torch.equal(whole, parts)


def test_absorbed_decode_through_the_kernels_equals_the_bmm_path(monkeypatch):
    """MLAAttention._absorbed_decode on the kernels against LATENTSERVE_MLA_ABSORB=0 (bmm's, cat)."""
    from service.config import ModelConfig
    from service.model.attention import AttnMetadata, MLAAttention
    from service.parallel import TPGroup

    cfg = ModelConfig(num_attention_heads=8, num_key_value_heads=8, q_lora_rank=64, kv_lora_rank=64,
                      qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, hidden_size=128)
    attn = MLAAttention(cfg, TPGroup.single(), 0, torch.float32).to(DEVICE)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
    q, kv, tables, ctx, _ = case(5, 4, 8, 64, 16, 4, torch.float32, 30)
    q = torch.randn(4, 8, 48, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    meta = AttnMetadata.__new__(AttnMetadata)
    meta.decode_context_lens, meta.decode_block_tables = ctx, tables
    with torch.no_grad():
        ours = attn._absorbed_decode(q, kv, meta)
        monkeypatch.setenv("LATENTSERVE_MLA_ABSORB", "0")
        theirs = attn._absorbed_decode(q, kv, meta)
    assert ours.shape == theirs.shape == (4, 8, 32)
    assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-5), (ours - theirs).abs().max()
