"""The residual add and RMS norm folded into the next projection (service/model/add_norm.py): the
GEMV and the MoE entry kernel against the same kernels on the row normed by the eager ops, the
new stream equal to the add's; a model's one-token logits the same with the fold on; and (CUDA
only) a decode graph that captured the folds against the eager step without them.

Runs on CUDA, or on a CPU with Triton installed and TRITON_INTERPRET=1 (kernels interpreted).
"""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEVICE, INTERPRET, kernel_marks, require_kernel_device

require_kernel_device()

from _model_utils import build_model, full_logits  # noqa: E402

from service.config import PRESETS  # noqa: E402
from service.model import add_norm, moe_entry  # noqa: E402
from service.model.layers import _rms_norm_hf  # noqa: E402

pytestmark = kernel_marks(300)
EPS = 1e-6


def _rows(k: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stream, the pending sublayer output (one row each) and a norm weight near 1."""
    g = torch.Generator().manual_seed(seed)
    h, add = (torch.randn(1, k, generator=g) * 3).to(DEVICE, dtype), torch.randn(1, k, generator=g).to(DEVICE, dtype)
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
    """One K step (small's fused_qkv_a), two (2100 in 2048-wide steps), and a narrow row."""
    h, add, norm = _rows(k, dtype, seed=n + k)
    w = (torch.randn(n, k, generator=torch.Generator().manual_seed(1)) / k ** 0.5).to(DEVICE, dtype)
    assert add_norm.enabled(h, add) is False  # off by default
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


def test_the_fold_takes_one_row_only(monkeypatch):
    h, add, norm = _rows(96, torch.float32, seed=0)
    monkeypatch.setenv("LATENTSERVE_FOLD_ADD_NORM", "1")
    assert add_norm.enabled(h, add) and not add_norm.enabled(h, None)
    two = torch.cat([h, h])
    assert not add_norm.enabled(two, two)
    w = torch.randn(40, 96).to(DEVICE)
    with pytest.raises(ValueError, match="one row"):
        moe_entry._entry(two, w, torch.randn(48, 96).to(DEVICE), w[:20], "silu", 1.0, None,
                         fold=(two, norm, EPS, torch.empty_like(two)))


def test_one_token_through_the_model_gives_the_same_logits(monkeypatch, spy):
    """`tiny` (MLA with q in LoRA form, latent MoE after a dense first layer) in fp32, one token
    cache-less: every layer after the first folds its input norm into fused_qkv_a, every MoE layer
    its post-attention norm into the entry kernel."""
    cfg = PRESETS["tiny"]
    model = build_model(cfg, device=DEVICE)
    monkeypatch.delenv("LATENTSERVE_FOLD_ADD_NORM", raising=False)
    ref = full_logits(model, [5])
    monkeypatch.setenv("LATENTSERVE_FOLD_ADD_NORM", "1")
    gemvs, entries = spy(torch.ops.latentserve, "gemv_add_norm"), spy(torch.ops.latentserve, "moe_entry_add_norm")
    got = full_logits(model, [5])
    assert len(gemvs) == cfg.num_hidden_layers - 1
    assert len(entries) == cfg.num_hidden_layers - cfg.first_k_dense_replace
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(INTERPRET, reason="CUDA graphs and compiled layers")
def test_a_decode_graph_with_the_folds_matches_the_eager_step_without(monkeypatch):
    from service import LLM
    from service.engine.plan import SeqChunk, StepPlan

    monkeypatch.setenv("LATENTSERVE_FOLD_ADD_NORM", "1")
    llm = LLM(model="tiny", dtype="bfloat16", device=DEVICE, seed=0, distributed_executor_backend="uni",
              max_num_seqs=1, cuda_graph_batch_sizes=[1])
    try:
        worker = llm.executor.rank0
        chunks = [SeqChunk(0, [7], 20, [0, 1])]
        with torch.inference_mode():
            for kv in worker.kv_caches:
                kv.normal_()
            before = worker.decode_graphs.replays
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                out = worker.execute(StepPlan(chunks))
                torch.cuda.synchronize()
            assert worker.decode_graphs.replays == before + 1, "the step did not replay a graph"
            monkeypatch.setenv("LATENTSERVE_FOLD_ADD_NORM", "0")
            ref = worker._eager_forward(chunks, worker.kv_caches)
    finally:
        llm.shutdown()
        torch._dynamo.reset()
    names = [e.name for e in prof.events()]
    assert any("_add_norm_gemv_kernel" in n for n in names), "the graph has no folded GEMV"
    assert add_norm.GUARD.failure is None
    rel = ((out.double() - ref.double()).norm() / ref.double().norm()).item()
    assert rel < 3e-2, rel  # bf16, as test_dense_mm_cuda's graph against eager
