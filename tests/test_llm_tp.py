"""Offline API through real Ray rank actors: TP 1, 2 and 4 give the same greedy tokens (fp32)."""

import random

import pytest

from service import LLM, InvalidRequest, SamplingParams
from service.config import ConfigError


def _prompts(n=16, vocab=1024, seed=0):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(2, vocab) for _ in range(rng.randrange(3, 24))]} for _ in range(n)]


GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def tp1_tokens():
    with LLM("tiny", tensor_parallel_size=1, dtype="float32") as llm:
        outs = llm.generate(_prompts(), GREEDY)
        # Bad input gets a clear error and the engine keeps serving afterwards.
        with pytest.raises(InvalidRequest, match="empty"):
            llm.generate([{"prompt_token_ids": []}], GREEDY)
        with pytest.raises(InvalidRequest, match="max_model_len|too long|longer"):
            llm.generate([{"prompt_token_ids": [5] * 5000}], GREEDY)
        again = llm.generate(_prompts()[:2], GREEDY)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs[:2]]
    return [o.outputs[0].token_ids for o in outs]


def test_tp1_generates(tp1_tokens):
    assert len(tp1_tokens) == 16 and all(len(t) == 32 for t in tp1_tokens)
    assert len({tuple(t) for t in tp1_tokens}) > 1, "all prompts gave the same tokens: degenerate model"


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_matches_tp1(tp, tp1_tokens):
    with LLM("tiny", tensor_parallel_size=tp, dtype="float32") as llm:
        outs = llm.generate(_prompts(), GREEDY)
        state = llm.collective_rpc("tail_state")
    assert [o.outputs[0].token_ids for o in outs] == tp1_tokens
    # auto mode: the fused tail is on at TP > 1 and decode batches take it
    assert all(layer["fused"] and layer["fused_calls"] > 0 for rank in state for layer in rank)


def test_bad_tp_is_a_clear_error():
    with pytest.raises(ConfigError, match="does not divide"):
        LLM("tiny", tensor_parallel_size=3)


def test_invalid_sampling_values():
    with pytest.raises(InvalidRequest, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(InvalidRequest, match="temperature"):
        SamplingParams(temperature=-1)
