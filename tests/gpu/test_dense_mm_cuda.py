"""LATENTSERVE_OPAQUE_MM on CUDA (service/model/dense_mm.py): the cuBLAS products against
float64; a decoder layer's two residual patterns compiled by Inductor at 256 rows, which copy
the added matrix (addmm) through F.linear and make no copy through the ops; and a decode graph
above the GEMV's rows (80 sequences, `tiny` in bf16) that gives the eager step's logits with the
switch on. (`small` at 256 rows: 22.0 -> 20.0 kernels a layer, run 83.)"""

from __future__ import annotations

import pytest
import torch
from kernel_env import GRAPH_SHAPES, rel_error

from service import LLM
from service.engine.plan import SeqChunk, StepPlan
from service.model import dense_mm
from service.model.layers import linear, rms_norm_hf

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = "cuda"
OVERRIDES = GRAPH_SHAPES
ROWS = 80  # above gemv.max_rows(): the projections are cuBLAS's


def test_products_match_float64_in_bf16():
    g = torch.Generator(device=DEV).manual_seed(0)
    x, w = torch.randn(ROWS, 512, device=DEV, generator=g), torch.randn(1024, 512, device=DEV, generator=g)
    x2, w2 = torch.randn(ROWS, 384, device=DEV, generator=g), torch.randn(1024, 384, device=DEV, generator=g)
    ref = x.double() @ w.double().t() + x2.double() @ w2.double().t()
    args = [t.bfloat16() for t in (x, w, x2, w2)]
    out = torch.ops.latentserve.mm_t_sum(*args)
    assert out.dtype == torch.bfloat16 and out.shape == (ROWS, 1024)
    assert rel_error(out, ref) < 1e-2
    assert rel_error(torch.ops.latentserve.mm_t(args[0], args[1]), x.double() @ w.double().t()) < 1e-2


def _replay_errors(llm: LLM) -> tuple[float, float]:
    """The median and largest per-row error of one replay's logits at ROWS sequences against the
    eager step."""
    worker = llm.executor.rank0
    with torch.no_grad():
        for kv in worker.kv_caches:
            kv.normal_()
    chunks = [SeqChunk(i, [7 + i], 20 + i % 9, [2 * i, 2 * i + 1]) for i in range(ROWS)]
    with torch.inference_mode():
        before = worker.decode_graphs.replays
        out = worker.execute(StepPlan(chunks))
        assert worker.decode_graphs.replays == before + 1, "the step did not replay a graph"
        ref = worker._eager_forward(chunks, worker.kv_caches)
    errs = sorted(rel_error(out[r], ref[r]) for r in range(ROWS))
    return errs[ROWS // 2], errs[-1]


def _copies(fn, *args) -> int:
    fn(*args)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return sum("Memcpy DtoD" in e.name for e in prof.events())


def test_the_residual_patterns_compile_without_a_copy(monkeypatch):
    torch.manual_seed(1)
    bf = dict(device=DEV, dtype=torch.bfloat16)
    h, x, w = torch.randn(256, 2048, **bf), torch.randn(256, 2048, **bf), torch.randn(2048, 2048, **bf) / 45
    a, wa, b, wb = torch.randn(256, 1024, **bf), torch.randn(2048, 1024, **bf) / 32, torch.randn(256, 768, **bf), \
        torch.randn(2048, 768, **bf) / 28
    norm = torch.ones(2048, **bf)

    def attention_out(h, x, w):  # DecoderLayer.leave: the stream, then its norm
        h = h + linear(x, w)
        return h, rms_norm_hf.eager(h, norm, 1e-6)

    def moe_out(a, wa, b, wb):  # the latent MoE's up-projection + shared down at TP 1
        if dense_mm.enabled(a):  # MoE._one_rank_tail
            return torch.ops.latentserve.mm_t_sum(a, wa, b, wb)
        return linear(a, wa) + linear(b, wb)  # tail.unfused_tail

    seen = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("LATENTSERVE_OPAQUE_MM", flag)
        torch._dynamo.reset()
        att, moe = torch.compile(attention_out), torch.compile(moe_out)
        seen[flag] = (_copies(att, h, x, w), _copies(moe, a, wa, b, wb))
        ref = (h.double() + x.double() @ w.double().t(), a.double() @ wa.double().t() + b.double() @ wb.double().t())
        assert rel_error(att(h, x, w)[0], ref[0]) < 1e-2 and rel_error(moe(a, wa, b, wb), ref[1]) < 1e-2
    torch._dynamo.reset()
    assert seen["0"][0] >= 1, f"the premise: addmm copies the residual ({seen})"
    assert seen["1"] == (0, 0), seen


def test_decode_graph_above_the_gemv_rows_matches_eager(monkeypatch):
    monkeypatch.setenv("LATENTSERVE_COMPILE", "layers")
    monkeypatch.setenv("LATENTSERVE_OPAQUE_MM", "1")
    llm = LLM(model="tiny", hf_overrides=OVERRIDES, dtype="bfloat16", device=DEV, seed=0,
              distributed_executor_backend="uni", max_num_seqs=ROWS, cuda_graph_batch_sizes=[ROWS])
    try:
        mid, worst = _replay_errors(llm)
    finally:
        llm.shutdown()
        torch._dynamo.reset()
    assert mid < 3e-2 and worst < 1.0, (mid, worst)  # bf16 as test_fusion's graphs: near-ties move a row at most
