"""The small-M GEMV (service/model/gemv.py) against a float64 reference and cuBLAS: shapes of
the decode step's projections (K and N not powers of 2 included), M from 1 to the row limit,
bf16 and fp32; deterministic; and `layers.linear` routing to it only where it applies.

Runs on CUDA, or on a CPU with Triton installed and TRITON_INTERPRET=1 (kernels interpreted).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from kernel_env import DEVICE, INTERPRET, kernel_marks, require_kernel_device, skip_interpreted_16bit_dot

require_kernel_device()

from service.model import dense_mm, gemv, gemv_gated, layers  # noqa: E402
from service.weights import fp8 as fmt  # noqa: E402

pytestmark = kernel_marks(300)
SHAPES = [(1344, 2048), (100, 96), (1024, 768)] if INTERPRET else [
    (1344, 2048), (3072, 768), (2048, 2048), (1024, 2048), (2048, 1024), (1536, 2048), (100, 96), (32768, 2048)]


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [1, 3, 8, 16, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_matches_reference(n, k, m, dtype, monkeypatch):
    """The kernel at every row count it may be turned on for (LATENTSERVE_GEMV_MAX_ROWS): the
    register product at one row, tensor-core tiles from two."""
    if m > 1:  # tensor-core tiles
        skip_interpreted_16bit_dot(dtype)
    monkeypatch.setenv("LATENTSERVE_GEMV_MAX_ROWS", "64")
    g = torch.Generator().manual_seed(n * 7 + k + m)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    assert gemv.supported(x, w) == (w.numel() <= gemv.MAX_WEIGHT_ELEMENTS)
    y = torch.ops.latentserve.gemv(x, w)
    assert y.shape == (m, n) and y.dtype == dtype
    ref = (x.double() @ w.double().t())
    # fp32 accumulation over K, then one rounding to the output dtype.
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.double(), ref, atol=tol * 4, rtol=tol)
    assert torch.equal(y, torch.ops.latentserve.gemv(x, w))  # deterministic


@pytest.mark.parametrize("n,k", SHAPES[:2])
@pytest.mark.parametrize("m", [65, 130, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rows_above_64_run_in_row_blocks(n, k, m, dtype, monkeypatch):
    """LATENTSERVE_GEMV_MAX_ROWS above 64: a grid of 64-row blocks (every row computed, the last
    block's padding masked), the plain and the normed paired kernel alike."""
    skip_interpreted_16bit_dot(dtype)
    monkeypatch.setenv("LATENTSERVE_GEMV_MAX_ROWS", "256")
    g = torch.Generator().manual_seed(n + k + m)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    assert gemv.supported(x, w)
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(torch.ops.latentserve.gemv(x, w).double(), x.double() @ w.double().t(),
                               atol=tol * 4, rtol=tol)
    norm = (1 + 0.1 * torch.randn(k, generator=g)).to(DEVICE, dtype)
    y = torch.ops.latentserve.gemv_pair_normed(x, norm, 1e-6, w, x[:, :96], w[:, :96])
    xd = x.double()
    ref = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.double()) @ w.double().t()
    torch.testing.assert_close(y.double(), ref + xd[:, :96] @ w[:, :96].double().t(), atol=tol * 8, rtol=tol * 2)


@pytest.mark.parametrize("n,k", SHAPES[:3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_whole_k_steps_match_reference(n, k, dtype, monkeypatch):
    """At one row (the default since run 39) a program reads all of K in one step (K 96 and 768
    pad to a power of two) and the loop after the first step runs zero times."""
    monkeypatch.setenv("LATENTSERVE_GEMV_MAX_K", "2048")
    assert gemv.config(1, n, k, gemv.sm_count(torch.device(DEVICE)))["BLOCK_K"] >= k
    g = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(torch.ops.latentserve.gemv(x, w).double(), x.double() @ w.double().t(),
                               atol=tol * 4, rtol=tol)


def test_leading_dims_and_strided_rows():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 200, generator=g).to(DEVICE)[..., :96]  # rows strided, last dim contiguous
    w = torch.randn(40, 96, generator=g).to(DEVICE)
    y = torch.ops.latentserve.gemv(x, w)
    torch.testing.assert_close(y, x @ w.t(), atol=1e-4, rtol=1e-5)


def test_linear_routes_by_rows(monkeypatch):
    monkeypatch.setenv("LATENTSERVE_GEMV_MAX_ROWS", "4")
    w = torch.randn(64, 32).to(DEVICE)
    assert gemv.supported(torch.randn(gemv.max_rows(), 32).to(DEVICE), w)
    assert not gemv.supported(torch.randn(gemv.max_rows() + 1, 32).to(DEVICE), w)
    assert not gemv.supported(torch.randn(2, 32).to(DEVICE, torch.bfloat16), w)  # dtype mismatch
    assert not gemv_gated.supported(torch.randn(1, 32).to(DEVICE), w, "silu")  # opt-in
    monkeypatch.setenv("LATENTSERVE_GATED_GEMV", "1")
    assert gemv_gated.supported(torch.randn(1, 32).to(DEVICE), w, "silu")
    assert not gemv_gated.supported(torch.randn(2, 32).to(DEVICE), w, "silu")  # a register product: one row only
    monkeypatch.setenv("LATENTSERVE_GEMV_MAX_ROWS", "0")
    assert not gemv.supported(torch.randn(1, 32).to(DEVICE), w)
    x = torch.randn(33, 32).to(DEVICE)  # above the limit: cuBLAS / torch
    torch.testing.assert_close(layers.linear(x, w), x @ w.t())


@pytest.mark.parametrize("act,beta,linear_beta", [("silu", 1.0, None), ("situ", 4.0, 8.0), ("situ", 4.0, None)])
@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gated_gemv_matches_act_and_mul(act, beta, linear_beta, m, dtype):
    """The MLP's gate/up GEMV with the activation in its epilogue against the torch path
    (`layers.act_and_mul` over cuBLAS/torch GEMM outputs) and a float64 reference."""
    from service.config import PRESETS

    cfg = dataclasses.replace(PRESETS["k3-tiny"], hidden_act=act, activation_situ_beta=beta,
                              activation_situ_linear_beta=linear_beta)
    inter, k = 200, 96
    g = torch.Generator().manual_seed(m + inter)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(2 * inter, k, generator=g) * 2 / k ** 0.5).to(DEVICE, dtype)
    h = torch.ops.latentserve.gated_gemv(x, w, *layers.act_params(cfg))
    gate_up = x @ w.t()
    torch_path = layers.act_and_mul(cfg)(gate_up[:, :inter], gate_up[:, inter:])
    gu = x.double() @ w.double().t()
    gd, ud = gu[:, :inter], gu[:, inter:]
    if act == "silu":
        ref = torch.nn.functional.silu(gd) * ud
    else:
        ref = beta * torch.tanh(gd / beta) * torch.sigmoid(gd)
        ref = ref * (linear_beta * torch.tanh(ud / linear_beta) if linear_beta else ud)
    tol = 2 ** -6 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(h.double(), ref, atol=tol * 4, rtol=tol)
    # The torch path rounds the same quantities in another order: a few bf16 ulps apart.
    torch.testing.assert_close(h.double(), torch_path.double(), atol=tol * 4, rtol=tol * 4)


@pytest.mark.parametrize("m", [2, 8, 16])
def test_dot_tiles_in_512_wide_k_steps(m, monkeypatch):
    """LATENTSERVE_GEMV_DOT_MAX_K=512 (bench/gpu.py's `gemv_dot_k512`): 2-16 bf16 rows in 512-wide
    K steps, alone and paired (two pipelined loops in one program), equal the reference as the
    256-wide default does; fp32 keeps 256 (its 512-wide stage would be 64 KB)."""
    assert gemv.dot_config(m, 2048, 2048, 132, 2)["BLOCK_K"] == 256
    monkeypatch.setenv("LATENTSERVE_GEMV_DOT_MAX_K", "512")
    assert gemv.dot_config(m, 2048, 2048, 132, 2)["BLOCK_K"] == 512
    assert gemv.dot_config(m, 2048, 2048, 132, 4)["BLOCK_K"] == 256
    skip_interpreted_16bit_dot(torch.bfloat16)
    g = torch.Generator().manual_seed(m)
    x, x2 = (torch.randn(m, k, generator=g).to(DEVICE, torch.bfloat16) for k in (2048, 768))
    w, w2 = ((torch.randn(2048, k, generator=g) / k ** 0.5).to(DEVICE, torch.bfloat16) for k in (2048, 768))
    tol = 2 ** -7
    y = torch.ops.latentserve.gemv(x, w)
    torch.testing.assert_close(y.double(), x.double() @ w.double().t(), atol=tol * 4, rtol=tol)
    y = torch.ops.latentserve.gemv_pair(x2, w[:, :768].contiguous(), x2, w2)
    ref = x2.double() @ w[:, :768].double().t() + x2.double() @ w2.double().t()
    torch.testing.assert_close(y.double(), ref, atol=tol * 4, rtol=tol)


@pytest.mark.parametrize("m", [1, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k,k2", [(2048, 1024, 768), (100, 96, 40)])
def test_gemv_pair_sums_two_projections(n, k, k2, dtype, m, monkeypatch):
    """x @ w^T + x2 @ w2^T in one launch: fp32 sums of both, one rounding."""
    if m > 1:  # tensor-core tiles
        skip_interpreted_16bit_dot(dtype)
    monkeypatch.setenv("LATENTSERVE_GEMV_MAX_ROWS", "16")
    g = torch.Generator().manual_seed(n + k2)
    x, x2 = torch.randn(m, k, generator=g).to(DEVICE, dtype), torch.randn(m, k2, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    w2 = (torch.randn(n, k2, generator=g) / k2 ** 0.5).to(DEVICE, dtype)
    assert gemv.pair_supported(x, w, x2, w2)
    y = torch.ops.latentserve.gemv_pair(x, w, x2, w2)
    ref = x.double() @ w.double().t() + x2.double() @ w2.double().t()
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    assert y.shape == (m, n) and y.dtype == dtype
    torch.testing.assert_close(y.double(), ref, atol=tol * 4, rtol=tol)
    assert not gemv.pair_supported(x, w, x2, w2[:-1])  # different widths


@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize("normed", [False, True])
@pytest.mark.parametrize("n,k,k2", [(256, 1024, 768), (100, 600, 300)])
def test_gemv_pair_with_an_fp8_second_weight(n, k, k2, normed, m):
    """An FP8 model's latent up-projection (16-bit) and shared down-projection (FP8, 128 x 128
    block scales) in one launch, with and without the latent norm, against float64 of the
    dequantized weight: the FP8 GEMV's tolerance (one output rounding, the 16-bit rounding of each
    scaled tile on tensor cores). K2 300: a partial scale block; n 100: a partial row block."""
    dtype = torch.float16 if INTERPRET else torch.bfloat16  # the interpreter's tl.dot takes no bf16
    g = torch.Generator().manual_seed(n + k2 + m)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    x2 = torch.randn(m, k2, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    q2, s2 = (t.to(DEVICE) for t in fmt.quantize(torch.randn(n, k2, generator=g) / k2 ** 0.5, (128, 128)))
    assert gemv.pair_supported(x, w, x2, q2, s2)
    assert not gemv.pair_supported(x, w, x2, q2)  # FP8 without its scales
    norm = (1 + 0.1 * torch.randn(k, generator=g)).to(DEVICE, dtype)
    if normed:
        y = torch.ops.latentserve.gemv_pair_normed(x, norm, 1e-6, w, x2, q2, 0, s2)
        xd = x.double()
        xd = xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.double()
    else:
        y = torch.ops.latentserve.gemv_pair(x, w, x2, q2, s2)
        xd = x.double()
    ref = xd @ w.double().t() + x2.double() @ fmt.dequantize(q2, s2, (128, 128)).double().t()
    assert y.shape == (m, n) and y.dtype == dtype
    assert (y.double() - ref).abs().max() <= 2 ** -7 * ref.abs().max() + 1e-3


@pytest.mark.parametrize("m", [1, 5, 40])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k,k2", [(2048, 1024, 768), (100, 600, 40)])
def test_gemv_pair_normed_norms_x_first(n, k, k2, dtype, m):
    """rms_norm(x) @ w^T + x2 @ w2^T in one launch equals rms_norm then gemv_pair (the normed rows
    rounded to x's dtype in both), and a float64 reference within the GEMV's tolerance; K 600
    takes several K steps of the norm's pass and of the product."""
    if m > 1:  # tensor-core tiles
        skip_interpreted_16bit_dot(dtype)
    g = torch.Generator().manual_seed(n + k2 + m)
    x = (torch.randn(m, k, generator=g) * 3).to(DEVICE, dtype)
    x2 = torch.randn(m, k2, generator=g).to(DEVICE, dtype)
    norm = (1 + 0.1 * torch.randn(k, generator=g)).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    w2 = (torch.randn(n, k2, generator=g) / k2 ** 0.5).to(DEVICE, dtype)
    y = torch.ops.latentserve.gemv_pair_normed(x, norm, 1e-6, w, x2, w2)
    assert y.shape == (m, n) and y.dtype == dtype
    xf = x.float()  # rms_norm's math and roundings, eager
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.float()).to(dtype)
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.double(), torch.ops.latentserve.gemv_pair(normed, w, x2, w2).double(),
                               atol=tol * 4, rtol=tol)
    xd = x.double()
    ref = (xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-6) * norm.double()) @ w.double().t()
    torch.testing.assert_close(y.double(), ref + x2.double() @ w2.double().t(), atol=tol * 8, rtol=tol * 2)


@pytest.mark.parametrize("slots", [0, 8])
@pytest.mark.parametrize("n,k,k2", [(2048, 1024, 768), (64, 96, 2100)])
def test_gemv_pair_early_gives_the_same_bits(n, k, k2, slots, monkeypatch):
    """LATENTSERVE_GEMV_PAIR_EARLY=1 (one row: the second weight's first tile before the PDL wait):
    the same sums in the same order, so the same bits, plain and normed with the slot sum; a second
    weight wider than one K step (2100 over 2048) keeps the loop for the rest. The Triton kernel,
    not the CUDA C GEMV that takes the plain pair on a GPU."""
    m = 1
    dtype = torch.float32 if INTERPRET else torch.bfloat16
    monkeypatch.setenv("LATENTSERVE_GEMV_MAX_ROWS", "16")
    monkeypatch.setenv("LATENTSERVE_GEMV_CUDA_MAX_ROWS", "0")
    g = torch.Generator().manual_seed(n + k2 + slots)
    x = torch.randn(m * max(1, slots), k, generator=g).to(DEVICE, torch.float32 if slots else dtype)
    x2 = torch.randn(m, k2, generator=g).to(DEVICE, dtype)
    norm = (1 + 0.1 * torch.randn(k, generator=g)).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    w2 = (torch.randn(n, k2, generator=g) / k2 ** 0.5).to(DEVICE, dtype)

    def pair():
        if slots:
            return torch.ops.latentserve.gemv_pair_normed(x, norm, 1e-6, w, x2, w2, slots)
        return torch.ops.latentserve.gemv_pair(x, w, x2, w2)

    before = pair()
    monkeypatch.setenv("LATENTSERVE_GEMV_PAIR_EARLY", "1")
    assert gemv.pair_early() and torch.equal(pair(), before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemv_pair_normed_sums_slots_first(dtype):
    """slots=8: x's rows are one token's 8 fp32 expert outputs, summed in slot order and rounded
    as moe_kernels.slot_sum does: the same bits as slot_sum, then the normed pair. One row only."""
    from service.model import moe_kernels

    m = 1
    g = torch.Generator().manual_seed(m)
    n, k, k2, slots = 256, 600, 40, 8
    parts = torch.randn(m * slots, k, generator=g).to(DEVICE)
    x2 = torch.randn(m, k2, generator=g).to(DEVICE, dtype)
    norm = (1 + 0.1 * torch.randn(k, generator=g)).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    w2 = (torch.randn(n, k2, generator=g) / k2 ** 0.5).to(DEVICE, dtype)
    summed = moe_kernels.slot_sum(parts, torch.empty(m, k, dtype=dtype, device=DEVICE), slots)
    y = torch.ops.latentserve.gemv_pair_normed(parts, norm, 1e-6, w, x2, w2, slots)
    assert y.shape == (m, n) and y.dtype == dtype
    assert torch.equal(y, torch.ops.latentserve.gemv_pair_normed(summed, norm, 1e-6, w, x2, w2))
    with pytest.raises(ValueError, match="one row only"):
        torch.ops.latentserve.gemv_pair_normed(torch.cat([parts, parts]), norm, 1e-6, w, torch.cat([x2, x2]), w2,
                                               slots)


@pytest.mark.parametrize("tokens", [1, 5])
def test_latent_moe_tail_with_the_norm_in_the_pair(tokens, monkeypatch, spy):
    """A latent MoE layer at TP 1 with its latent norm inside the paired GEMV (the default at one
    row; LATENTSERVE_GEMV_PAIR_NORM_MAX_ROWS=64 for five) gives the layer's output with the norm
    as its own op (=0)."""
    from test_moe_entry import latent_moe_layer

    layer, x = latent_moe_layer("k3-tiny")
    x = torch.randn(tokens, x.shape[1], generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    monkeypatch.setenv("LATENTSERVE_GEMV_PAIR_NORM_MAX_ROWS", "0")
    ref = layer(x)
    monkeypatch.setenv("LATENTSERVE_GEMV_PAIR_NORM_MAX_ROWS", "1" if tokens == 1 else "64")
    calls = spy(torch.ops.latentserve, "gemv_pair_normed")
    torch.testing.assert_close(layer(x), ref, atol=1e-5, rtol=1e-4)
    assert len(calls) == 1


def test_latent_moe_one_rank_tail_equals_the_two_projections(monkeypatch):
    """A one-token latent MoE layer at TP 1: the paired GEMV equals up-projection + shared down + add."""
    from test_moe_entry import latent_moe_layer

    layer, x = latent_moe_layer("k3-tiny")
    latent, h, _ = layer._entry(x)
    assert layer._one_rank_tail(latent, h, layer._norm_weight()) is not None
    paired = layer(x)
    monkeypatch.setenv("LATENTSERVE_GEMV_PAIR", "0")
    # unpaired: cuBLAS's two products on a GPU (dense_mm.py), the layer's own path in the interpreter
    unpaired = layer._one_rank_tail(latent, h, layer._norm_weight())
    assert (unpaired is not None) == dense_mm.enabled(latent)
    torch.testing.assert_close(paired, layer(x), atol=1e-5, rtol=1e-4)


def test_latent_moe_tail_with_the_slot_sum_in_the_pair(monkeypatch, spy):
    """LATENTSERVE_GEMV_PAIR_SLOTS=1: at one token the experts' unsummed outputs go to the normed
    pair (one launch for slot sum, norm, up and shared down) with the layer's output unchanged."""
    from test_moe_entry import latent_moe_layer

    layer, x = latent_moe_layer("k3-tiny")
    ref = layer(x)
    monkeypatch.setenv("LATENTSERVE_GEMV_PAIR_SLOTS", "1")
    parts, pairs = spy(torch.ops.latentserve, "moe_experts_parts"), spy(torch.ops.latentserve, "gemv_pair_normed")
    torch.testing.assert_close(layer(x), ref, atol=1e-6, rtol=1e-6)
    assert (len(parts), len(pairs)) == (1, 1)
    # Two tokens: the pair norm's one row does not apply, nor does this. The parts still come,
    # for the slot sum with the norm (the default above one row), but no pair takes them.
    two = torch.cat([x, x])
    torch.testing.assert_close(layer(two), torch.cat([ref, ref]), atol=1e-5, rtol=1e-4)
    assert len(pairs) == 1
