"""The residual add and RMS norm folded into the next projection (service/model/add_norm.py): the
GEMV and the MoE entry kernel at one row against the same kernels on the row normed by the eager
ops, the new stream equal to the add's; a model's logits the same with the fold on and off; and
(CUDA only) a decode graph that captured the folds against the eager step without them.

Runs on CUDA, or on a CPU with Triton installed and TRITON_INTERPRET=1 (kernels interpreted).
"""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEVICE, GRAPH_SHAPES, INTERPRET, graph_steps, kernel_marks, require_kernel_device

require_kernel_device()

from _model_utils import build_model, full_logits  # noqa: E402

from service.config import PRESETS  # noqa: E402
from service.model import add_norm, moe_entry  # noqa: E402
from service.model.layers import _rms_norm_hf  # noqa: E402

pytestmark = kernel_marks(300)
EPS = 1e-6


def _rows(k: int, dtype: torch.dtype, seed: int, m: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stream, the pending sublayer output (m rows each) and a norm weight near 1."""
    g = torch.Generator().manual_seed(seed)
    h, add = (torch.randn(m, k, generator=g) * 3).to(DEVICE, dtype), torch.randn(m, k, generator=g).to(DEVICE, dtype)
    return h, add, (1 + torch.randn(k, generator=g) / 4).to(DEVICE, dtype)


def _check_sum(total: torch.Tensor, h: torch.Tensor, add: torch.Tensor) -> None:
    """The new stream is the add's, bit for bit; the interpreter's bf16 casts truncate (a GPU's round
    to nearest even), so there within an ulp."""
    if INTERPRET and h.dtype == torch.bfloat16:
        torch.testing.assert_close(total, h + add, atol=0, rtol=2 ** -7)
    else:
        assert torch.equal(total, h + add)


def _tol(dtype: torch.dtype) -> dict:
    # the normed row may differ by an ulp where the mean's summation order rounds it the other way
    return dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k", [(1344, 2048), (100, 2100), (40, 96)])
def test_gemv_add_norm_is_the_gemv_of_the_normed_sum(n, k, dtype):
    """One K step at small's fused_qkv_a, two at 2100, a narrow row."""
    h, add, norm = _rows(k, dtype, seed=n + k)
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(1)) / k ** 0.5).to(DEVICE, dtype)
    y, total = torch.ops.latentserve.gemv_add_norm(h, add, norm, EPS, w)
    _check_sum(total, h, add)
    normed = _rms_norm_hf(h + add, norm, EPS)
    torch.testing.assert_close(y, torch.ops.latentserve.gemv(normed, w), **_tol(dtype))
    torch.testing.assert_close(y.double(), normed.double() @ w.double().t(), **_tol(dtype))


@pytest.mark.parametrize("act,beta,linear_beta", [("silu", 1.0, None), ("situ", 4.0, 8.0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("k", [96, 2100])
def test_entry_add_norm_is_the_entry_of_the_normed_sum(act, beta, linear_beta, dtype, k):
    h, add, norm = _rows(k, dtype, seed=k)
    g = torch.Generator().manual_seed(2)
    down, shared, router = ((torch.randn(rows, k, generator=g) / k ** 0.5).to(DEVICE, dtype) for rows in (40, 48, 20))
    *got, total = torch.ops.latentserve.moe_entry_add_norm(h, add, norm, EPS, down, shared, router, act, beta,
                                                           linear_beta)
    _check_sum(total, h, add)
    want = torch.ops.latentserve.moe_entry(_rms_norm_hf(h + add, norm, EPS), down, shared, router, act, beta,
                                           linear_beta)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **_tol(dtype))


def test_the_fold_takes_one_row_of_16_or_32_bit_weights(monkeypatch):
    """On by default, at one row; LATENTSERVE_FOLD_ADD_NORM=0 turns it off (`fold_add_norm_off`)."""
    h, add, norm = _rows(128, torch.float32, seed=0, m=2)
    monkeypatch.delenv("LATENTSERVE_FOLD_ADD_NORM", raising=False)
    assert add_norm.enabled(h[:1], add[:1]) and not add_norm.enabled(h, add) and not add_norm.enabled(h[:1], None)
    assert not add_norm.enabled(h[:1, ::2], add[:1, ::2].contiguous())  # a strided row
    monkeypatch.setenv("LATENTSERVE_FOLD_ADD_NORM", "0")
    assert not add_norm.enabled(h[:1], add[:1])
    w = torch.randn(16, 128).to(DEVICE)
    with pytest.raises(ValueError, match="one row"):
        torch.ops.latentserve.gemv_add_norm(h, add, norm, EPS, w)
    q, scale = torch.zeros(128, 128, dtype=torch.float8_e4m3fn).to(DEVICE), torch.ones(1, 1).to(DEVICE)
    with pytest.raises(ValueError, match="one row of 16/32-bit"):
        moe_entry._entry(h[:1], q, q, h[:1].expand(20, -1), "silu", 1.0, None, scale, scale,
                         fold=(add[:1], norm, EPS, torch.empty_like(h[:1])))


@pytest.mark.parametrize("tokens", [[5], [5, 9, 2]])
def test_tokens_through_the_model_give_the_same_logits(tokens, monkeypatch, spy):
    """`tiny` (MLA with q in LoRA form, latent MoE after a dense first layer) in fp32, cache-less,
    the fold on (the default) against off: at one token every layer after the first folds its
    input norm into fused_qkv_a, every MoE layer its post-attention norm into the entry kernel; at
    three none does."""
    cfg = PRESETS["tiny"]
    model = build_model(cfg, device=DEVICE)
    monkeypatch.setenv("LATENTSERVE_FOLD_ADD_NORM", "0")
    ref = full_logits(model, tokens)
    monkeypatch.delenv("LATENTSERVE_FOLD_ADD_NORM")
    gemvs, entries = spy(torch.ops.latentserve, "gemv_add_norm"), spy(torch.ops.latentserve, "moe_entry_add_norm")
    routes = spy(torch.ops.latentserve, "moe_entry_add_norm_route")  # the same fold, with the expert choice
    got = full_logits(model, tokens)
    one = len(tokens) == 1
    assert len(gemvs) == (cfg.num_hidden_layers - 1 if one else 0)
    assert len(entries) + len(routes) == (cfg.num_hidden_layers - cfg.first_k_dense_replace if one else 0)
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs and compiled layers")
def test_decode_graphs_with_the_folds_match_the_eager_step_without(monkeypatch):
    """`tiny` in bf16, graphs captured with the fold on at 1 and 4 sequences (its kernels at 1, the
    plain ones at 4), each replay against the eager step with it on and off."""
    steps = graph_steps(monkeypatch, "LATENTSERVE_FOLD_ADD_NORM", "1", GRAPH_SHAPES)
    assert add_norm.GUARD.failure is None
    for rows, step in steps.items():
        folds = [n for n in step.kernels if "_add_norm_gemv_kernel" in n]
        assert bool(folds) == (rows == 1), (rows, sorted(set(folds)))
        graph_err, kernel_err = step.errors()  # bf16, as test_dense_mm_cuda's graph against eager
        assert graph_err < 3e-2 and kernel_err < 3e-2, (rows, graph_err, kernel_err)
