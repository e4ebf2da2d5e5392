"""Sleep rules through the offline API at TP 2 (DESIGN §2): what level 2 frees, refusals, poisoning."""

import pytest

from service import LLM, SamplingParams
from service.weights import checkpoint_tensors
from service.worker import EngineStateError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [3, 14, 15, 92, 65]}, {"prompt_token_ids": [27, 18, 28]}]


def _toks(llm):
    outs = llm.generate(PROMPTS, GREEDY)
    assert not any(o.error for o in outs), [o.error for o in outs]
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def llm():
    with LLM("tiny", tensor_parallel_size=2, dtype="float32", enable_sleep_mode=True,
             poison_discarded=True) as llm:
        yield llm


def test_level2_releases_parameters_and_refuses_until_new_weights(llm):
    before = _toks(llm)
    reports = llm.sleep(level=2)
    for r in reports:
        assert r["bytes_released"] >= 0.95 * r["parameter_bytes"], r
        assert r["rss_before"] - r["rss_after"] >= 0.5 * r["parameter_bytes"], r
    again = llm.sleep(level=2)
    assert all(r.get("noop") for r in again)
    llm.wake_up(["weights"])
    llm.wake_up(["kv_cache"])
    with pytest.raises(EngineStateError, match="discarded the weights"):
        llm.generate(PROMPTS, GREEDY)
    # Forcing a forward reads the poisoned parameters: NaN, not stale values.
    probes = llm.collective_rpc("probe_forward", [3, 14, 15])
    assert all(p["nan"] for p in probes)
    # A partial update cannot make discarded weights valid again.
    full = list(checkpoint_tensors(llm.config.model_config, seed=0))
    llm.update_weights([(n, t) for n, t in full if n == "lm_head.weight"])
    with pytest.raises(EngineStateError, match="still missing"):
        llm.generate(PROMPTS, GREEDY)
    # New weights (the same logical model) make the engine serve the same tokens again.
    version = llm.update_weights(full)
    assert version == 2
    assert _toks(llm) == before


def test_kv_cache_asleep_refuses(llm):
    llm.sleep(level=1)
    llm.wake_up(["weights"])
    with pytest.raises(EngineStateError, match="KV cache is asleep"):
        llm.generate(PROMPTS, GREEDY)
    llm.wake_up(["kv_cache"])
    assert not llm.is_sleeping()
    _toks(llm)


def test_interleaved_layout_reports_mixed_chunks():
    with LLM("tiny", tensor_parallel_size=1, dtype="float32", enable_sleep_mode=True,
             pool_layout="interleaved", distributed_executor_backend="uni") as llm:
        before = _toks(llm)
        r = llm.sleep(level=2)[0]
        assert r["chunks"].get("mixed", 0) > 0, r["chunks"]
        assert r["bytes_backed_up"] > 0
        llm.wake_up()
        mem = llm.collective_rpc("memory_report")[0]
        assert mem, mem
        # mixed chunks were kept, so only parameter-only chunks lost their contents
        llm.update_weights(checkpoint_tensors(llm.config.model_config, seed=0))
        assert _toks(llm) == before
