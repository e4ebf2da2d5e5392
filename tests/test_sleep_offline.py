"""Sleep rules through the offline API at TP 2 (DESIGN §2): what level 2 frees, refusals, poisoning,
and a sleep that fails on one rank (a one-shot failure armed on rank 1 through collective_rpc)
rolled back by the coordinator so that no rank stays asleep."""

import pytest

from service import LLM, SamplingParams
from service.lifecycle import EngineStateError
from service.llm import SleepError
from service.weights import checkpoint_tensors

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


def _arm_rank1(llm) -> None:
    armed = llm.collective_rpc("fail_next_sleep", 1)  # the worker's test hook, one shot, rank 1 only
    assert [a["armed"] for a in armed] == [False, True]


def test_sleep_failing_on_one_rank_leaves_no_rank_asleep(llm):
    before = _toks(llm)
    _arm_rank1(llm)
    with pytest.raises(SleepError, match=r"rolled back: every rank is awake.*rank 1: injected sleep failure") as e:
        llm.sleep(level=1)
    assert e.value.status == 500
    outcome = {o["rank"]: o for o in e.value.outcomes}
    assert outcome[0]["ok"] and outcome[0]["rolled_back"] == "woken"  # it had slept: woken again
    assert not outcome[1]["ok"] and outcome[1]["rolled_back"] == "was awake"
    assert [s["asleep"] for s in llm.collective_rpc("status")] == [[], []]
    assert not llm.is_sleeping() and llm.status()["state"] == "running"
    assert _toks(llm) == before
    assert llm.sleep(level=1)[1]["asleep"] == ["kv_cache", "weights"]  # the hook was one shot
    llm.wake_up()
    assert _toks(llm) == before

    # Level 2: rank 0 discarded its weights before rank 1 failed. Rolled back, no rank is asleep;
    # the discarded weights cannot come back by waking, so generating is refused until new ones.
    _arm_rank1(llm)
    with pytest.raises(SleepError, match="rolled back: every rank is awake"):
        llm.sleep(level=2)
    ranks = llm.collective_rpc("status")
    assert [s["asleep"] for s in ranks] == [[], []] and [s["weights_valid"] for s in ranks] == [False, True]
    assert llm.status()["state"] == "weights-invalid"
    with pytest.raises(EngineStateError, match="discarded the weights"):
        llm.generate(PROMPTS, GREEDY)
    llm.update_weights(checkpoint_tensors(llm.config.model_config, seed=0))
    assert llm.status()["state"] == "running" and _toks(llm) == before
