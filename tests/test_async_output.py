"""Async output processing (`--async-output`, on by default on CUDA) through the public LLM API on
TP 2 mp ranks: the same tokens, text, logprobs and finish reasons as steps in order, for greedy,
seeded and stopped requests, and a level-1 sleep in the middle collects the step in flight."""

import random
import threading
import time

from service import LLM, SamplingParams

KW = dict(dtype="float32", hf_overrides={"num_hidden_layers": 3}, tensor_parallel_size=2,
          distributed_executor_backend="mp", enable_sleep_mode=True)


def _prompts(n=6, seed=5):
    rng = random.Random(seed)
    return [[rng.randrange(2, 1024) for _ in range(rng.randrange(3, 16))] for _ in range(n)]


def _run(llm: LLM) -> list:
    """Greedy with logprobs, seeded n=2, stop strings, stop token ids: every field that reaches a user."""
    params = [
        SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.9, top_p=0.9, seed=11, n=2, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=["e", "a"]),
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=list(range(2, 1024, 4))),
    ]
    prompts = [{"prompt_token_ids": p} for p in _prompts()]
    out = []
    for sp in params:
        for o in llm.generate(prompts, sp):
            out.append([(c.token_ids, c.text, c.finish_reason, c.stop_reason,
                         c.logprobs and [sorted(d) for d in c.logprobs]) for c in o.outputs])
    return out


LONG = SamplingParams(temperature=0, max_tokens=160, ignore_eos=True)


def _long(llm: LLM) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in _prompts(3, 9)], LONG)]


def test_async_output_matches_in_order_steps_and_survives_sleep():
    with LLM("tiny", async_output="off", **KW) as llm:
        ref, long_ref = _run(llm), _long(llm)
    with LLM("tiny", async_output="on", **KW) as llm:
        assert llm.executor.rank0_call("engine_stats")["async_output"]
        assert _run(llm) == ref
        # A sleep while streams decode: the pause collects the step in flight, keeps the requests,
        # and after wake they finish with the tokens of an undisturbed run.
        got: list = []
        worker = threading.Thread(target=lambda: got.append(_long(llm)))
        worker.start()
        steps = llm.executor.rank0_call("engine_stats")["steps"]
        while llm.executor.rank0_call("engine_stats")["steps"] < steps + 20:
            time.sleep(0.01)
        llm.sleep(1, mode="keep")
        stats = llm.executor.rank0_call("engine_stats")
        assert worker.is_alive() and stats["requests"] == 3 and stats["running"] == 0, stats
        llm.wake_up()
        worker.join(120)
        assert got == [long_ref]
    reasons = {c[2] for r in ref for c in r}
    assert reasons == {"length", "stop"}, reasons  # the stops did fire
