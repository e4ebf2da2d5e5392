"""bench/prefill_flops.py counts what the engine's eager prefill computes: on the tiny model (CPU,
cache-less chunks from position 0, enough tokens that the routed experts run as per-expert
matmuls) torch's FLOP counter sees exactly the counted projections, experts and lm_head in its
matmuls, and the attention's batched matmuls are the counted causal pairs at full L x L (the CPU
math path computes the masked half too)."""

import os
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from service import LLM
from service.config import resolve_model
from service.engine.plan import SeqChunk

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

from prefill_flops import PARTS, prefill_flops  # noqa: E402


def test_counts_match_torch_flop_counter_on_the_eager_prefill():
    lens = [40, 50]
    with LLM("tiny", distributed_executor_backend="uni", dtype="float32") as llm:
        worker, cfg = llm.executor.rank0, llm.config.model_config
        chunks = [SeqChunk(i, [5 + (7 * j) % 900 for j in range(n)], 0, [], state_slot=i) for i, n in enumerate(lens)]
        with torch.inference_mode(), FlopCounterMode(display=False) as counter:
            worker._eager_forward(chunks, None)
    seen = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    counted = prefill_flops(cfg, lens)
    assert set(counted) == set(PARTS) and all(v > 0 for v in counted.values())
    assert seen["aten.mm"] == sum(counted.values()) - counted["attention"]
    full_over_causal = sum(n * n for n in lens) / sum(n * (n + 1) // 2 for n in lens)
    assert seen["aten.bmm"] == pytest.approx(counted["attention"] * full_over_causal, rel=1e-9)


def test_small_24_layers_and_what_is_not_counted():
    cfg, _ = resolve_model("small", {"num_hidden_layers": 24})
    f = prefill_flops(cfg, [1024] * 8)
    assert 16e12 < sum(f.values()) < 17.5e12  # 8 x 1024 tokens: ~2 x 1.0 G active params per token + attention
    assert f["routed_experts"] == 2 * 8192 * 8 * 23 * (1024 * 2 * 768 + 768 * 1024)
    assert prefill_flops(cfg, [1024] * 8, logits_rows=0)["lm_head"] == 0
    kimi, _ = resolve_model("k3-tiny")
    with pytest.raises(ValueError, match="KDA"):
        prefill_flops(kimi, [16])
