"""The CUDA C decode GEMV (service/model/gemv_cuda.py) against float64 and against the Triton
GEMV it stands in for: 1-16 rows, the `small` preset's shapes, outputs and K that are not multiples
of the kernel's 8 outputs or 32-wide chunks, strided rows, the paired projection, CUDA graphs, and
the engine's decode graphs against its eager step. Needs a GPU (no interpreter for CUDA C)."""

from __future__ import annotations

import pytest
import torch
from kernel_env import GRAPH_SHAPES, graph_steps, record_calls, rel_error, require_cuda_c

require_cuda_c()

from service.model import gemv, gemv_cuda  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
SWITCH = "LATENTSERVE_GEMV_CUDA_MAX_ROWS"


def operands(m: int, n: int, k: int, seed: int, row_stride: int | None = None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, row_stride or k, device="cuda", generator=g).to(torch.bfloat16)[:, :k]
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(torch.bfloat16)
    return x, w


@pytest.mark.parametrize("warps", ["4", "8"], ids=["4_warps", "8_warps"])
@pytest.mark.parametrize("m", [1, 2, 5, 8, 9, 16])
@pytest.mark.parametrize("n,k", [(1344, 2048), (3072, 768), (2048, 2048), (100, 520), (8, 32), (19, 8)])
def test_matches_float64_and_the_triton_gemv(monkeypatch, m, n, k, warps):
    monkeypatch.setenv("LATENTSERVE_GEMV_CUDA_K_WARPS", warps)
    x, w = operands(m, n, k, seed=m * 1000 + n + k)
    monkeypatch.setenv(SWITCH, "0")
    triton_y = torch.ops.latentserve.gemv(x, w)
    monkeypatch.setenv(SWITCH, "16")
    calls = record_calls(monkeypatch, gemv_cuda, "run")
    y = torch.ops.latentserve.gemv(x, w)
    assert calls == [True], gemv_cuda.GUARD.failure
    ref = x.double() @ w.double().T
    assert y.dtype == torch.bfloat16 and y.shape == (m, n)
    assert rel_error(y, ref) < 6e-3  # bf16 output rounding
    # Both are fp32 sums of the same bf16 products, in a different order: within an output rounding.
    assert (y.float() - triton_y.float()).abs().max().item() <= 2 * ref.abs().max().item() * 2 ** -8


def test_rows_strided_and_leading_dims(monkeypatch):
    """x rows 16-byte strided inside a wider buffer, and x [2, 3, K] (the op's leading dims)."""
    monkeypatch.setenv(SWITCH, "8")
    calls = record_calls(monkeypatch, gemv_cuda, "run")
    x, w = operands(6, 264, 256, seed=3, row_stride=384)
    assert x.stride(0) == 384
    y = torch.ops.latentserve.gemv(x.view(2, 3, 256), w)
    assert y.shape == (2, 3, 264) and calls == [True]
    assert rel_error(y.reshape(6, 264), x.double() @ w.double().T) < 6e-3


def test_rows_it_does_not_take_go_to_triton(monkeypatch):
    """Above the switch's rows, above 16, off, misaligned or not bf16: the Triton GEMV, same result."""
    calls = record_calls(monkeypatch, gemv_cuda, "run")
    x, w = operands(8, 64, 128, seed=5)
    for rows, xx, ww in [("4", x, w), ("16", torch.cat([x, x, x]), w), ("0", x, w),
                         ("16", x.float(), w.float())]:
        monkeypatch.setenv(SWITCH, rows)
        y = torch.ops.latentserve.gemv(xx, ww)
        assert rel_error(y, xx.double() @ ww.double().T) < 6e-3
    odd = torch.empty(8, 129, device="cuda", dtype=torch.bfloat16)[:, 1:]
    odd.copy_(x)
    assert not gemv_cuda.supported(odd, w)  # rows not 16-byte aligned
    assert calls == []


@pytest.mark.parametrize("warps", ["4", "8"], ids=["4_warps", "8_warps"])
@pytest.mark.parametrize("m", [1, 8, 12])
def test_pair_sums_both_projections(monkeypatch, m, warps):
    """gemv_pair (a latent MoE's up-projection and its shared experts' down-projection): one fp32 sum."""
    monkeypatch.setenv("LATENTSERVE_GEMV_CUDA_K_WARPS", warps)
    x, w = operands(m, 2048, 1024, seed=7)
    x2, w2 = operands(m, 2048, 768, seed=8)
    monkeypatch.setenv(SWITCH, "16")
    calls = record_calls(monkeypatch, gemv_cuda, "run")
    y = torch.ops.latentserve.gemv_pair(x, w, x2, w2)
    assert calls == [True]
    ref = x.double() @ w.double().T + x2.double() @ w2.double().T
    assert rel_error(y, ref) < 6e-3
    monkeypatch.setenv(SWITCH, "0")
    triton_y = torch.ops.latentserve.gemv_pair(x, w, x2, w2)
    assert (y.float() - triton_y.float()).abs().max().item() <= 2 * ref.abs().max().item() * 2 ** -8


def test_graph_replay_reads_new_rows(monkeypatch):
    """Captured once, replayed after x changes in place: the same as an eager call on the new rows."""
    monkeypatch.setenv(SWITCH, "8")
    x, w = operands(8, 2048, 2048, seed=9)
    torch.ops.latentserve.gemv(x, w)  # builds the kernel before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = torch.ops.latentserve.gemv(x, w)
    x.copy_(operands(8, 2048, 2048, seed=10)[0])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, torch.ops.latentserve.gemv(x, w))  # one order of sums: bitwise equal
    assert gemv_cuda.GUARD.failure is None


def test_decode_graphs_with_the_kernel_match_the_eager_step_without(monkeypatch):
    """`tiny` in bf16: decode graphs captured with the kernel on at 1 and 4 sequences, each replay
    against the eager step with it on and off (the Triton GEMV)."""
    steps = graph_steps(monkeypatch, SWITCH, "16", GRAPH_SHAPES)
    assert gemv_cuda.GUARD.failure is None and gemv.GUARD.failure is None
    for rows, step in steps.items():
        assert any("gemv_small" in n for n in step.kernels), (rows, sorted(set(step.kernels)))
        graph_err, kernel_err = step.errors()  # against the eager step with the switch on, and off
        assert graph_err < 3e-2 and kernel_err < 3e-2, (rows, graph_err, kernel_err)
