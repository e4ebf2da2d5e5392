"""MLA decode's absorbed projections as Triton kernels (model/mla_absorb.py) against float64, on
the strided views the attention passes them; the attention kernel with q_latent and q_pe as two
inputs equals it with their cat; and the absorbed decode through the kernels equals the bmm path.

Runs on CUDA, or on a CPU with Triton installed and TRITON_INTERPRET=1 (kernels interpreted).
"""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEVICE, INTERPRET, kernel_marks, rel_error, require_kernel_device

require_kernel_device()

from test_mla_decode_kernel import case  # noqa: E402

from service.model import mla_absorb, mla_decode, mla_merge  # noqa: E402

pytestmark = kernel_marks(300)
DTYPES = [(torch.float32, 1e-5)] + ([] if INTERPRET else [(torch.bfloat16, 1e-2)])


def kv_b(heads, nope, v, lora, dtype, seed=0):
    """kv_b_proj's weight viewed per head, and its W_UK / W_UV slices (views, as attention.py takes them)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(heads * (nope + v), lora, generator=g) * lora ** -0.5).to(DEVICE, dtype)
    w = w.view(heads, nope + v, lora)
    return w, w[:, :nope], w[:, nope:]


def attention_layer(**overrides):
    """An fp32 MLA layer (8 heads, kv_lora_rank 64, rope 16, nope and v 32) with random weights, and its config."""
    from service.config import ModelConfig
    from service.model.attention import MLAAttention
    from service.parallel import TPGroup

    cfg = ModelConfig(num_attention_heads=8, num_key_value_heads=8, q_lora_rank=64, kv_lora_rank=64,
                      qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32, hidden_size=128, **overrides)
    attn = MLAAttention(cfg, TPGroup.single(), 0, torch.float32).to(DEVICE)
    with torch.no_grad():
        for p in attn.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
    return attn, cfg


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
    err = rel_error(out, ref)
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
    err = rel_error(out, ref)
    assert err < tol, f"relative error {err:.2e}"


def check_both_at_deepseek_dims(batch: int, heads: int, dtype, tol: float) -> None:
    """absorb_q and absorb_out at DeepSeek-V3's head dims (nope and v 128, kv_lora_rank 512)
    against float64."""
    nope, v, lora = 128, 128, 512
    _, w_uk, w_uv = kv_b(heads, nope, v, lora, dtype, seed=batch)
    g = torch.Generator().manual_seed(batch)
    q = torch.randn(batch, heads, nope, generator=g).to(DEVICE, dtype)
    o = torch.randn(batch, heads, lora, generator=g).to(DEVICE)
    q_lat = torch.ops.latentserve.mla_absorb_q(q, w_uk)
    out = torch.ops.latentserve.mla_absorb_out(o, w_uv)
    refs = (torch.einsum("bhn,hnd->bhd", q.cpu().double(), w_uk.cpu().double()),
            torch.einsum("bhd,hvd->bhv", o.to(dtype).cpu().double(), w_uv.cpu().double()).reshape(batch, heads * v))
    for got, ref in zip((q_lat, out), refs):
        err = rel_error(got, ref)
        assert err < tol, f"relative error {err:.2e}"


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("batch", [1, 5, 16, 40])
def test_wide_k_steps_match_float64(monkeypatch, dtype, tol, batch):
    """LATENTSERVE_MLA_ABSORB_WIDE_K_MAX_ROWS: 128- and 256-wide K steps up to 16 sequences, the
    64-wide ones above (40)."""
    monkeypatch.setenv("LATENTSERVE_MLA_ABSORB_WIDE_K_MAX_ROWS", "16")
    check_both_at_deepseek_dims(batch, 4, dtype, tol)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("batch", [17, 40, 64, 100, 130])
def test_l2_tiles_match_float64(monkeypatch, dtype, tol, batch):
    """LATENTSERVE_MLA_ABSORB_L2_TILES: above the wide-K rows, the rows and outputs a program that
    `l2_tiles` picks (16-64 rows, 16-128 outputs; the grid's row blocks end mid-block at 17, 40, 100
    and 130)."""
    monkeypatch.setenv("LATENTSERVE_MLA_ABSORB_L2_TILES", "1")
    size = torch.tensor([], dtype=dtype).element_size()
    picked = {mla_absorb.l2_tiles(batch, 16, 128, 512, size, size, 132),
              mla_absorb.l2_tiles(batch, 16, 512, 128, 4, size, 132)}
    assert picked - {(64, 64), (64, 32)}, "no tile differs from the default ones"
    check_both_at_deepseek_dims(batch, 16, dtype, tol)


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


def absorbed_decode_case():
    """An fp32 MLA layer, 4 sequences' queries [4, 8, 48], their paged cache, and decode metadata."""
    from service.model.attn_metadata import AttnMetadata

    attn, _ = attention_layer()
    _, kv, tables, ctx, _ = case(5, 4, 8, 64, 16, 4, torch.float32, 30)
    q = torch.randn(4, 8, 48, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    meta = AttnMetadata.__new__(AttnMetadata)
    meta.decode_context_lens, meta.decode_block_tables = ctx, tables
    return attn, q, kv, meta


def decode_step(cfg):
    """A step of 3 decodes (contexts 1, 6, 13 in blocks of 4) for an attention_layer: its metadata,
    a cache (random, so every slot holds something), the layer input and its rope tables."""
    from service.engine.plan import SeqChunk
    from service.model.attn_metadata import AttnMetadata
    from service.model.layers import RotaryEmbedding

    block_size, ctx = 4, [1, 6, 13]
    chunks = [SeqChunk(i, [5], n - 1, [i * 4 + j for j in range(4)], True, i) for i, n in enumerate(ctx)]
    meta = AttnMetadata.build(chunks, block_size, DEVICE)
    cache = torch.randn(12, block_size, 80, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    cos, sin = RotaryEmbedding(cfg).to(DEVICE).lookup(meta.positions)
    return meta, cache, x, cos, sin


def test_absorbed_decode_through_the_kernels_equals_the_bmm_path(monkeypatch):
    """MLAAttention._absorbed_decode on the kernels against LATENTSERVE_MLA_ABSORB=0 (bmm's, cat)."""
    attn, q, kv, meta = absorbed_decode_case()
    with torch.no_grad():
        ours = attn._absorbed_decode(q, kv, meta)
        monkeypatch.setenv("LATENTSERVE_MLA_ABSORB", "0")
        theirs = attn._absorbed_decode(q, kv, meta)
    assert ours.shape == theirs.shape == (4, 8, 32)
    assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-5), (ours - theirs).abs().max()


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("batch,splits,lora", [(1, 32, 512), (3, 4, 64), (8, 16, 512), (2, 1, 64)])
def test_decode_through_w_uv_equals_merge_then_absorb_out(dtype, tol, batch, splits, lora):
    """mla_decode with w_uv (merge and W_UV in one kernel, `merge_out`; one split: absorb_out of
    it) against the merged output then absorb_out, and against float64 of that merged output."""
    heads, rope, v, block_size = 16, 64 if lora == 512 else 16, 128 if lora == 512 else 32, 16
    q, kv, tables, ctx, _ = case(batch + splits, batch, heads, lora, rope, block_size, dtype, 90)
    _, _, w_uv = kv_b(heads, 128, v, lora, dtype, seed=batch)
    scale = (lora + rope) ** -0.5
    merged = mla_decode.mla_decode(q, kv, tables, ctx, lora, scale, splits=splits)
    fused = mla_decode.mla_decode(q, kv, tables, ctx, lora, scale, splits=splits, w_uv=w_uv)
    two = torch.ops.latentserve.mla_absorb_out(merged, w_uv)
    assert fused.shape == two.shape == (batch, heads * v) and fused.dtype == dtype
    ref = torch.einsum("bhd,hvd->bhv", merged.to(dtype).cpu().double(), w_uv.cpu().double()).reshape(batch, -1)
    for out in (fused, two):
        err = rel_error(out, ref)
        assert err < tol, f"relative error {err:.2e}"


def test_absorbed_decode_merges_through_w_uv(monkeypatch, spy):
    """LATENTSERVE_MLA_MERGE_OUT_MAX_ROWS=8: MLAAttention._absorbed_decode at 4 sequences through
    the one merge + W_UV kernel equals the merge and absorb_out kernels."""
    attn, q, kv, meta = absorbed_decode_case()
    with torch.no_grad():
        monkeypatch.setenv("LATENTSERVE_MLA_MERGE_OUT_MAX_ROWS", "0")
        separate = attn._absorbed_decode(q, kv, meta)
        monkeypatch.setenv("LATENTSERVE_MLA_MERGE_OUT_MAX_ROWS", "8")
        calls = spy(mla_merge, "merge_out")
        fused = attn._absorbed_decode(q, kv, meta)
    assert len(calls) == 1 and fused.shape == separate.shape == (4, 8, 32)
    torch.testing.assert_close(fused, separate, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("splits", [None, 1, 4])
def test_decode_writes_the_new_token_and_attends_it(splits):
    """new_kv/new_slots: each row's new token (its slot still poisoned) is attended as the last
    position and written to its slot, nothing else in the cache changes; equal to writing first."""
    lora, rope, block_size, batch = 64, 16, 4, 5
    q, kv, tables, ctx, ctx_list = case(23, batch, 8, lora, rope, block_size, torch.float32, 40)
    ctx_list[1] = 4  # a new token at a block's last slot
    ctx[1] = 4
    slots = torch.tensor([int(tables[i, (n - 1) // block_size]) * block_size + (n - 1) % block_size
                          for i, n in enumerate(ctx_list)], device=DEVICE)
    new = torch.randn(batch, lora + rope, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    flat = kv.view(-1, lora + rope)
    flat[slots] = float("nan")  # whatever the slot held before
    scale = (lora + rope) ** -0.5
    written = kv.clone()
    written.view(-1, lora + rope)[slots] = new
    expect = mla_decode.mla_decode(q, written, tables, ctx, lora, scale, splits=splits)
    before = kv.clone()
    out = mla_decode.mla_decode(q, kv, tables, ctx, lora, scale, splits=splits, new_kv=new, new_slots=slots)
    assert torch.isfinite(out).all()
    assert torch.allclose(out, expect, rtol=1e-5, atol=1e-6), (out - expect).abs().max()
    assert torch.equal(flat[slots], new)
    others = torch.ones(flat.shape[0], dtype=torch.bool, device=DEVICE)
    others[slots] = False
    assert torch.equal(flat[others].nan_to_num(7.0), before.view(-1, lora + rope)[others].nan_to_num(7.0))


def test_attention_decode_writes_kv_in_the_kernel(monkeypatch):
    """MLAAttention.forward on a step of decodes: the kernel's own KV write (the new row attended
    after the tile loop) equals write_kv's (LATENTSERVE_MLA_WRITE_KV=0) in output and cache."""
    attn, cfg = attention_layer()
    meta, cache, x, cos, sin = decode_step(cfg)
    assert attn._decode_writes_kv(torch.empty(3, 8, 48, device=DEVICE), cache, meta)
    with torch.no_grad():
        ours_cache = cache.clone()
        ours = attn(x, cos, sin, meta, ours_cache)
        monkeypatch.setenv("LATENTSERVE_MLA_WRITE_KV", "0")
        theirs_cache = cache.clone()
        theirs = attn(x, cos, sin, meta, theirs_cache)
    assert torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6), (ours - theirs).abs().max()
    assert torch.equal(ours_cache, theirs_cache)


@pytest.mark.parametrize("interleave", [False, True], ids=["halves", "interleaved"])
@pytest.mark.parametrize("splits", [None, 1])
def test_decode_ropes_the_query_where_it_loads_it(interleave, splits):
    """rope=(cos, sin, interleave): the unroped q_pe roped inside the split kernel equals q_pe
    roped by layers.apply_rope first (fp32: the same products, one rounding)."""
    from service.model.layers import apply_rope

    lora, rope_dim, block_size, batch = 64, 16, 4, 3
    q, kv, tables, ctx, _ = case(13, batch, 8, lora, rope_dim, block_size, torch.float32, 40)
    g = torch.Generator().manual_seed(5)
    angles = torch.rand(batch, rope_dim // 2, generator=g) * 6.0
    cos, sin = angles.cos().to(DEVICE), angles.sin().to(DEVICE)
    scale = (lora + rope_dim) ** -0.5
    raw = q[..., lora:]
    roped = mla_decode.mla_decode(q[..., :lora].contiguous(), kv, tables, ctx, lora, scale, splits=splits,
                                  q_pe=apply_rope(raw, cos, sin, interleave))
    inside = mla_decode.mla_decode(q[..., :lora].contiguous(), kv, tables, ctx, lora, scale, splits=splits,
                                   q_pe=raw, rope=(cos, sin, interleave))
    torch.testing.assert_close(inside, roped, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="rope tables"):
        mla_decode.mla_decode(q[..., :lora].contiguous(), kv, tables, ctx, lora, scale, q_pe=raw,
                              rope=(cos[:, :4], sin[:, :4], interleave))


@pytest.mark.parametrize("interleave", [False, True], ids=["halves", "interleaved"])
def test_attention_decode_ropes_the_query_in_the_kernel(monkeypatch, spy, interleave):
    """MLAAttention.forward on a step of decodes with LATENTSERVE_MLA_ROPE_IN_DECODE=1: the
    project step leaves q unroped and the decode kernel ropes it; output and cache equal."""
    from service.model import attention

    attn, cfg = attention_layer()
    attn.interleave = interleave
    meta, cache, x, cos, sin = decode_step(cfg)
    ropes = spy(attention, "apply_rope")
    with torch.no_grad():
        theirs_cache = cache.clone()
        theirs = attn(x, cos, sin, meta, theirs_cache)
        assert len(ropes) == 2  # q's rope part, then k_pe
        monkeypatch.setenv("LATENTSERVE_MLA_ROPE_IN_DECODE", "1")
        assert attn._absorbed_kernels(x, meta, cache) and attn._rope_in_decode()
        ours_cache = cache.clone()
        ours = attn(x, cos, sin, meta, ours_cache)
    assert len(ropes) == 3  # k_pe only: q's is the kernel's
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert torch.equal(ours_cache, theirs_cache)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("batch", [1, 5])
def test_absorb_out_applies_the_output_gate(dtype, tol, batch):
    """gate (before its sigmoid, a strided view as gemv_multi leaves it): absorb_out's rows times
    sigmoid(gate), each factor rounded to the model dtype as the torch multiply takes them."""
    heads, v, lora = 4, 32, 64
    _, _, w_uv = kv_b(heads, 32, v, lora, dtype, seed=batch)
    g = torch.Generator().manual_seed(batch)
    o = torch.randn(batch, heads, lora, generator=g).to(DEVICE)
    wide = torch.randn(batch, heads * v + 24, generator=g).to(DEVICE, dtype)
    gate = wide[:, 24:]
    out = torch.ops.latentserve.mla_absorb_out(o, w_uv, gate)
    ref = torch.ops.latentserve.mla_absorb_out(o, w_uv) * gate.sigmoid()
    exact = dtype == torch.float32
    torch.testing.assert_close(out, ref, atol=0 if exact else tol, rtol=1e-6 if exact else tol)
    with pytest.raises(ValueError, match="output gate"):
        torch.ops.latentserve.mla_absorb_out(o, w_uv, gate[:, :-1])


@pytest.mark.parametrize("merge_out", ["0", "8"], ids=["absorb_out", "merge_out"])
def test_attention_decode_gates_in_w_uv_kernel(monkeypatch, merge_out):
    """Kimi's output gate in a decode-only step with LATENTSERVE_MLA_GATE_IN_KERNEL=1: applied in
    absorb_out's epilogue (with the merge_out candidate on, by the torch multiply after it);
    output and cache equal to the gate applied before o_proj."""
    attn, cfg = attention_layer(mla_use_output_gate=True)
    meta, cache, x, cos, sin = decode_step(cfg)
    absorb_out, gated = torch.ops.latentserve.mla_absorb_out, []
    monkeypatch.setattr(torch.ops.latentserve, "mla_absorb_out",
                        lambda o, w, gate=None: gated.append(gate is not None) or absorb_out(o, w, gate))
    monkeypatch.setenv("LATENTSERVE_MLA_GATE_IN_KERNEL", "0")
    with torch.no_grad():
        theirs_cache = cache.clone()
        theirs = attn(x, cos, sin, meta, theirs_cache)
        monkeypatch.setenv("LATENTSERVE_MLA_GATE_IN_KERNEL", "1")
        monkeypatch.setenv("LATENTSERVE_MLA_MERGE_OUT_MAX_ROWS", merge_out)
        ours_cache = cache.clone()
        ours = attn(x, cos, sin, meta, ours_cache)
    assert gated == ([False, True] if merge_out == "0" else [False])
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert torch.equal(ours_cache, theirs_cache)
