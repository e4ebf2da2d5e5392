"""LATENTSERVE_OPAQUE_MM on CUDA (service/model/dense_mm.py): the cuBLAS products against
float64, and a decode graph above the GEMV's rows (80 sequences, `tiny` in bf16) whose compiled
layers then make no device-to-device copies (with the switch off, Inductor's addmm copies a
residual a layer) and still give the eager step's logits."""

from __future__ import annotations

import pytest
import torch

from service import LLM
from service.engine.plan import SeqChunk, StepPlan

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

DEV = "cuda"
OVERRIDES = dict(kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, initializer_range=0.1)
ROWS = 80  # above gemv.max_rows(): the projections are cuBLAS's


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def test_products_match_float64_in_bf16():
    g = torch.Generator(device=DEV).manual_seed(0)
    x, w = torch.randn(ROWS, 512, device=DEV, generator=g), torch.randn(1024, 512, device=DEV, generator=g)
    x2, w2 = torch.randn(ROWS, 384, device=DEV, generator=g), torch.randn(1024, 384, device=DEV, generator=g)
    ref = x.double() @ w.double().t() + x2.double() @ w2.double().t()
    args = [t.bfloat16() for t in (x, w, x2, w2)]
    out = torch.ops.latentserve.mm_t_sum(*args)
    assert out.dtype == torch.bfloat16 and out.shape == (ROWS, 1024)
    assert _rel(out, ref) < 1e-2
    assert _rel(torch.ops.latentserve.mm_t(args[0], args[1]), x.double() @ w.double().t()) < 1e-2


def _replay_copies(llm: LLM) -> tuple[int, float, float]:
    """Device-to-device copies in one replay at ROWS sequences; the median and largest per-row
    error of its logits against the eager step."""
    worker = llm.executor.rank0
    with torch.no_grad():
        for kv in worker.kv_caches:
            kv.normal_()
    chunks = [SeqChunk(i, [7 + i], 20 + i % 9, [2 * i, 2 * i + 1]) for i in range(ROWS)]
    with torch.inference_mode():
        worker.execute(StepPlan(chunks))  # the first replay: not profiled
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            before = worker.decode_graphs.replays
            out = worker.execute(StepPlan(chunks))
            torch.cuda.synchronize()
        assert worker.decode_graphs.replays == before + 1, "the step did not replay a graph"
        ref = worker._eager_forward(chunks, worker.kv_caches)
    copies = sum("Memcpy DtoD" in e.name for e in prof.events())
    errs = sorted(_rel(out[r], ref[r]) for r in range(ROWS))
    return copies, errs[ROWS // 2], errs[-1]


def test_no_copies_in_compiled_layers_above_the_gemv_rows(monkeypatch):
    monkeypatch.setenv("LATENTSERVE_COMPILE", "layers")
    seen = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("LATENTSERVE_OPAQUE_MM", flag)
        llm = LLM(model="tiny", hf_overrides=OVERRIDES, dtype="bfloat16", device=DEV, seed=0,
                  distributed_executor_backend="uni", max_num_seqs=ROWS, cuda_graph_batch_sizes=[ROWS])
        try:
            layers = len(llm.executor.rank0.model.model.layers)
            seen[flag] = _replay_copies(llm)
        finally:
            llm.shutdown()
        torch._dynamo.reset()
    (off, _, _), (on, on_mid, on_max) = seen["0"], seen["1"]
    assert off >= layers, f"the premise: addmm's copy a layer with the switch off ({seen})"
    assert on <= off - layers, seen
    assert on_mid < 3e-2 and on_max < 1.0, seen  # bf16 as test_fusion's graphs: near-ties move a row at most
