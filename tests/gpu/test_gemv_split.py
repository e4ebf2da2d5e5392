"""The GEMV's split-K candidate (service/model/gemv_split.py, LATENTSERVE_GEMV_SPLIT_K=1) against a
float64 reference: alone and paired, 2-64 rows, bf16 and fp32; the same bits on every call (the
last program to arrive sums the splits in order) and counters left zeroed; `plan`'s choices.

Runs on CUDA, or on a CPU with Triton installed and TRITON_INTERPRET=1 (kernels interpreted).
"""

from __future__ import annotations

import pytest
import torch
from kernel_env import DEVICE, INTERPRET, kernel_marks, require_kernel_device, skip_interpreted_16bit_dot

require_kernel_device()

from service.model import gemv, gemv_split  # noqa: E402

pytestmark = kernel_marks(300)
SHAPES = [(1344, 2048), (100, 96)] if INTERPRET else [(1344, 2048), (3072, 768), (2048, 2048), (100, 96)]


def test_plan_splits_where_few_long_programs_would_run():
    """At 64 rows fused_qkv_a's 84 programs of 16 outputs (~320 KB each through an SM) become
    more, shorter ones; a shape already spread over the SMs with little to read stays unsplit."""
    cfg = gemv_split.plan(64, 1344, 2048, 0, 132, 2, 64)
    assert cfg is not None and cfg["SPLIT"] > 1
    programs = -(-1344 // cfg["BLOCK_N"]) * cfg["SPLIT"]
    assert 84 < programs <= 132 * 2 and cfg["CHUNK"] * cfg["SPLIT"] >= 2048
    paired = gemv_split.plan(8, 2048, 512, 768, 132, 2, 16)
    assert paired is None or (paired["CHUNK"] * paired["SPLIT"] >= 512 and paired["CHUNK2"] * paired["SPLIT"] >= 768)
    assert gemv_split.plan(130, 2048, 2048, 0, 132, 2, 64) is None  # above 64 rows: the row blocks
    assert gemv_split.plan(4, 100, 96, 0, 132, 2, 16) is None


def _counted(monkeypatch) -> list:
    calls, real = [], gemv_split.launch
    monkeypatch.setattr(gemv_split, "launch", lambda *a: calls.append(real(*a)) or calls[-1])
    return calls


@pytest.mark.parametrize("n,k", SHAPES)
@pytest.mark.parametrize("m", [2, 8, 40, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_split_k_matches_reference_and_repeats_bitwise(n, k, m, dtype, monkeypatch):
    skip_interpreted_16bit_dot(dtype)
    monkeypatch.setenv("LATENTSERVE_GEMV_SPLIT_K", "1")
    calls = _counted(monkeypatch)
    g = torch.Generator().manual_seed(n + k + m)
    x = torch.randn(m, k, generator=g).to(DEVICE, dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(DEVICE, dtype)
    y = torch.ops.latentserve.gemv(x, w)
    split = gemv_split.plan(m, n, k, 0, gemv.sm_count(x.device), x.element_size(), gemv.rows_tile(m, True)) is not None
    assert calls == [split]
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.double(), x.double() @ w.double().t(), atol=tol * 4, rtol=tol)
    assert torch.equal(y, torch.ops.latentserve.gemv(x, w))
    if split:
        assert not gemv_split.COUNTERS.buffers[x.device].any()


@pytest.mark.parametrize("m", [5, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k,k2", [(2048, 512, 768), (100, 600, 40)])
def test_split_k_pair_sums_both_projections(n, k, k2, m, dtype, monkeypatch):
    """The latent MoE's up-projection and shared down-projection in one split launch: both K
    ranges cut into the same number of splits."""
    skip_interpreted_16bit_dot(dtype)
    monkeypatch.setenv("LATENTSERVE_GEMV_SPLIT_K", "1")
    g = torch.Generator().manual_seed(m + n)
    x, x2 = (torch.randn(m, kk, generator=g).to(DEVICE, dtype) for kk in (k, k2))
    w, w2 = ((torch.randn(n, kk, generator=g) / kk ** 0.5).to(DEVICE, dtype) for kk in (k, k2))
    y = torch.ops.latentserve.gemv_pair(x, w, x2, w2)
    ref = x.double() @ w.double().t() + x2.double() @ w2.double().t()
    tol = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.double(), ref, atol=tol * 4, rtol=tol)
