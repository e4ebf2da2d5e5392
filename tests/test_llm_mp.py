"""The 'mp' executor (one spawned process per rank, no Ray): TP 2 gives TP 1's greedy tokens
with the fused tail on, sleep/wake and weight updates work, and failures keep their type."""

import random
import time

import pytest

from service import LLM, SamplingParams
from service.lifecycle import EngineStateError
from service.llm import SleepError
from service.weights import export_state

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
KW = dict(dtype="float32", hf_overrides={"num_hidden_layers": 3})


def _prompts(n=8, seed=3):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(2, 1024) for _ in range(rng.randrange(3, 16))]} for _ in range(n)]


def _tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY)]


def test_mp_tp2_matches_uni_tp1_and_survives_sleep():
    with LLM("tiny", distributed_executor_backend="uni", **KW) as llm:
        ref = _tokens(llm)
        named = list(export_state(llm.executor.rank0.model).items())
    with LLM("tiny", tensor_parallel_size=2, distributed_executor_backend="mp", enable_sleep_mode=True,
             **KW) as llm:
        assert _tokens(llm) == ref
        state = llm.collective_rpc("tail_state")
        assert len(state) == 2
        assert all(layer["fused"] and layer["fused_calls"] > 0 for rank in state for layer in rank)
        pids = {p["pid"] for p in llm.collective_rpc("ping")}
        assert len(pids) == 2, "ranks must be separate processes"

        awake = llm.collective_rpc("status")[0]["tail_epochs"]
        llm.sleep(level=1)
        assert llm.is_sleeping()
        # The flags sleep with the weights (unmapped on a GPU): reported as of the sleep, not read.
        asleep = llm.collective_rpc("status")[0]["tail_epochs"]
        assert asleep == {**awake, "as_of": "sleep"}
        assert all(layer["epoch"] is None for rank in llm.collective_rpc("tail_state") for layer in rank)
        llm.wake_up()
        assert _tokens(llm) == ref

        # Level 2 discards the parameters: generating is refused until new weights arrive.
        llm.sleep(level=2)
        llm.wake_up()
        with pytest.raises(EngineStateError, match="load new weights"):
            llm.generate(_prompts()[:1], GREEDY)
        assert llm.update_weights(named) == 1
        assert _tokens(llm) == ref


def test_mp_rank_failure_is_reported_per_rank():
    with LLM("tiny", tensor_parallel_size=2, distributed_executor_backend="mp", enable_sleep_mode=True,
             **KW) as llm:
        llm.collective_rpc("fail_next_sleep")
        with pytest.raises(SleepError, match="injected sleep failure") as info:
            llm.sleep(level=1)
        assert [o.get("ok") for o in info.value.outcomes].count(False) == 2
        assert "rolled back" in str(info.value)
        # One rank fails: the other had slept and is woken again; nothing is left half asleep.
        ref = _tokens(llm)
        llm.executor.ranks[1].call("collective_rpc", "fail_next_sleep").result(10)
        with pytest.raises(SleepError, match="rolled back.*rank 1: injected"):
            llm.sleep(level=1)
        assert not llm.is_sleeping()
        assert _tokens(llm) == ref
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match="unknown collective_rpc method"):
            llm.collective_rpc("no_such_rpc")
        assert time.monotonic() - t0 < 30
        # A caller that gives up on a call (asyncio cancels a wrapped future on a client's
        # disconnect) must not take the rank's reader down with it.
        for _ in range(3):
            llm.executor.ranks[0].call("collective_rpc", "ping").cancel()
        assert llm.executor.ranks[0].call("collective_rpc", "ping").result(10)["pid"]
        assert _tokens(llm) == ref
