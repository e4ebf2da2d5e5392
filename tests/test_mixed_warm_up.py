"""The startup warm-up of mixed steps (prefill_graphs.warm_up_mixed_steps, run by CUDA workers)
touches nothing a sequence owns: it runs in the scratch KV block and state row. Checked on the
CPU worker, MLA-only and Kimi-K3 (KDA state rows): a sequence's decode after a warm-up, between
its prefill and that decode, equals the same decode without one, bit for bit."""

from __future__ import annotations

import pytest
import torch

from service import LLM
from service.engine.plan import SeqChunk, StepPlan
from service.model.prefill_graphs import warm_up_mixed_steps

PROMPT = [5 + (7 * j) % 900 for j in range(21)]


@pytest.mark.parametrize("model", ["tiny", "k3-tiny"])
def test_warm_up_leaves_sequences_alone(model):
    llm = LLM(model=model, dtype="float32", device="cpu", seed=0, distributed_executor_backend="uni",
              max_num_seqs=8, cuda_graph_batch_sizes=[1, 2, 4, 8])
    worker = llm.executor.rank0
    blocks = [0, 1]  # the engine's first blocks and state row 0: what a warm-up must not touch

    def decode_after_prefill(warm: bool) -> torch.Tensor:
        worker.execute(StepPlan([SeqChunk(0, PROMPT, 0, blocks, state_slot=0)]))
        if warm:
            warm_up_mixed_steps(worker.execute, worker.config)
        return worker.execute(StepPlan([SeqChunk(0, [9], len(PROMPT), blocks, state_slot=0)])).clone()

    try:
        assert torch.equal(decode_after_prefill(warm=True), decode_after_prefill(warm=False))
    finally:
        llm.shutdown()
