"""The L2 prefetch (model/l2_prefetch.py) changes no number: decode graphs and eager steps with it
on give the very tokens and logprobs of the engine without it, before and after a level-2 sleep
(whose wake restores the weights at the addresses the prefetch tables hold)."""

from __future__ import annotations

import pytest
import torch
from test_engine_cuda import generate, graphs, make_llm

from service import SamplingParams
from service.weights import checkpoint_tensors

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)


def _run(llm) -> list:
    return [(o.token_ids, [sorted(lp.items()) for lp in o.logprobs]) for o in generate(llm, params=GREEDY)]


@pytest.mark.parametrize("evict_last", ["0", "1"])
def test_prefetch_keeps_every_token_and_logprob(monkeypatch, evict_last):
    monkeypatch.delenv("LATENTSERVE_L2_PREFETCH", raising=False)
    llm = make_llm("cuda", "bfloat16", enable_sleep_mode=True)
    try:
        want = _run(llm)
    finally:
        llm.shutdown()
    monkeypatch.setenv("LATENTSERVE_L2_PREFETCH", "256")
    monkeypatch.setenv("LATENTSERVE_L2_PREFETCH_EVICT_LAST", evict_last)
    llm = make_llm("cuda", "bfloat16", enable_sleep_mode=True)
    try:
        prefetch = llm.executor.rank0.model.model.prefetch
        assert prefetch is not None and prefetch.evict_last == (evict_last == "1")
        assert graphs(llm) is not None and graphs(llm).graphs
        assert len(prefetch.tables) == len(llm.executor.rank0.model.model.layers)  # built by the warm-ups
        assert _run(llm) == want
        llm.sleep(2)
        llm.wake_up()
        llm.update_weights(checkpoint_tensors(llm.config.model_config, seed=0))  # the dummy weights again
        assert _run(llm) == want
    finally:
        llm.shutdown()
