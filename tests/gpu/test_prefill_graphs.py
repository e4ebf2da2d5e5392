"""Piecewise prefill graphs (model/prefill_graphs.py) against the eager path of the same engine,
for an MLA model and for Kimi-K3, step by step through the worker, with
LATENTSERVE_PREFILL_GRAPHS=0 (read per step) as the baseline. A step whose token count is a bucket runs the very kernels of the eager step at the
same shapes, so its logits must be equal bit for bit; below a bucket the padding rows change
GEMM shapes (and so cuBLAS's kernel choice), which moves bf16 logits by rounding only.
"""

from __future__ import annotations

import os
import random

import pytest
import torch
from kernel_env import GRAPH_SHAPES

from service import LLM
from service.engine.plan import SeqChunk, StepPlan
from service.model.kda import KDAState

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

OVERRIDES = GRAPH_SHAPES
BLOCK = 16


@pytest.fixture(scope="module", params=["tiny", "k3-tiny"])
def llm(request):
    """tiny (MLA layers, widths the Triton decode kernel takes) and k3-tiny (Kimi-K3: KDA and MLA
    layers, attention residuals, output gates)."""
    overrides = OVERRIDES if request.param == "tiny" else dict(initializer_range=0.1)
    engine = LLM(model=request.param, hf_overrides=overrides, dtype="bfloat16", device="cuda", seed=0,
                 distributed_executor_backend="uni", max_num_batched_tokens=1024, enable_sleep_mode=True)
    yield engine
    engine.shutdown()


def prompt(seq: int, n: int, start: int = 0) -> list[int]:
    rng = random.Random(seq)
    return [rng.randrange(4, 1024) for _ in range(start + n)][start:]


def chunk(seq: int, n: int, start: int = 0, decode: bool = False) -> SeqChunk:
    blocks = list(range(seq * 32, seq * 32 + 32))  # 512 positions a sequence
    ids = [7 + seq] if decode else prompt(seq, n, start)
    return SeqChunk(seq, ids, start, blocks, state_slot=seq)


def run(worker, chunks, graphs: bool) -> torch.Tensor:
    os.environ["LATENTSERVE_PREFILL_GRAPHS"] = "1" if graphs else "0"
    try:
        return worker.execute(StepPlan(chunks)).float()
    finally:
        os.environ.pop("LATENTSERVE_PREFILL_GRAPHS", None)


def kda_states(worker) -> list[torch.Tensor]:
    """The KDA layers' state rows: a step advances them in place, so unlike MLA's KV rows (rewritten
    with the same values) a second run of a decode or a later chunk would start from another state."""
    return [t for c in worker.kv_caches if isinstance(c, KDAState) for t in (c.conv, c.recurrent)]


def both(worker, chunks) -> tuple[torch.Tensor, torch.Tensor]:
    """The step eagerly, then through the graphs from the same state (the same KV rows rewritten
    with the same values, the KDA state rows put back as the eager run found them)."""
    pg = worker.prefill_graphs
    before = pg.replays
    saved = [t.clone() for t in kda_states(worker)]
    eager = run(worker, chunks, graphs=False)
    for t, s in zip(kda_states(worker), saved):
        t.copy_(s)
    assert pg.replays == before, "the switch did not turn the graphs off"
    graphed = run(worker, chunks, graphs=True)
    assert pg.replays == before + 1, "the step did not run through the prefill graphs"
    return eager, graphed


def test_captured_buckets(llm):
    pg = llm.executor.rank0.prefill_graphs
    assert pg is not None, "no prefill graphs on CUDA"
    assert pg.sizes == [64, 128, 256, 512, 1024]
    layers = len(llm.executor.rank0.model.layers)
    assert pg.stats()["graphs"] == len(pg.sizes) * (layers + 1)


def test_step_at_a_bucket_is_bitwise_eager(llm):
    worker = llm.executor.rank0
    eager, graphed = both(worker, [chunk(0, 40), chunk(1, 24)])  # 64 tokens: the bucket itself
    assert torch.equal(eager, graphed), f"max diff {(eager - graphed).abs().max():.3g}"


def test_padded_prompts_mixed_steps_and_continuations_match_eager(llm):
    worker = llm.executor.rank0
    steps = [
        [chunk(2, 20), chunk(3, 37), chunk(4, 50)],  # 107 tokens: bucket 128
        # decodes of those, a new whole prompt and a later chunk of a prompt (position 50 on)
        [chunk(2, 1, 20, decode=True), chunk(3, 1, 37, decode=True), chunk(5, 33), chunk(4, 30, 50)],
        [chunk(6, 300)],  # bucket 512
    ]
    for chunks in steps:
        eager, graphed = both(worker, chunks)
        assert eager.shape == graphed.shape == (len(chunks), 1024)
        scale = eager.abs().max().item()
        err = (eager - graphed).abs().max().item()
        # bf16 rounding of a few layers: ~1% of the logits' scale; a wrong row would be ~100%.
        assert err <= 0.03 * scale, f"{len(chunks)} chunks: graphs differ from eager by {err:.3g} (scale {scale:.3g})"
        assert (eager.argmax(-1) == graphed.argmax(-1)).float().mean() >= 0.75


def test_graphs_survive_level2_discard_and_reload(llm):
    worker = llm.executor.rank0
    chunks = [chunk(7, 64)]
    before = run(worker, chunks, graphs=True)
    ids = worker.prefill_graphs.stats()
    report = llm.sleep(2)[0]
    assert not report["weights_valid"]
    llm.wake_up()
    from service.weights import checkpoint_tensors

    cfg = llm.config.model_config
    llm.update_weights(checkpoint_tensors(cfg, seed=1))
    other = run(worker, chunks, graphs=True)
    assert not torch.equal(other, before), "new weights, same logits: the graphs do not read the weights in place"
    llm.update_weights(checkpoint_tensors(cfg, seed=0))
    assert torch.equal(run(worker, chunks, graphs=True), before), "logits changed after a level-2 cycle"
    assert worker.prefill_graphs.stats()["graphs"] == ids["graphs"]
