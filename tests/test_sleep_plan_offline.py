"""The seed's test plan (DESIGN §4) through the offline API at TP 8 on CPU, with its negative control."""

import random
import time

from service import LLM, SamplingParams

TP = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
KW = dict(tensor_parallel_size=TP, dtype="float32", hf_overrides={"num_hidden_layers": 4},
          enable_sleep_mode=True, sleep_preserve_parameter_names=["*"], fused_tail="auto")


def _prompts():
    rng = random.Random(7)
    return [{"prompt_token_ids": [rng.randrange(2, 1024) for _ in range(rng.randrange(4, 12))]} for _ in range(16)]


def _tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY)]


def _assert_fused_everywhere(llm):
    state = llm.collective_rpc("tail_state")
    assert len(state) == TP
    for rank_layers in state:
        assert len(rank_layers) == 3  # 4 layers, first is dense
        assert all(layer["fused"] and layer["fused_calls"] > 0 for layer in rank_layers), rank_layers


def test_seed_plan_tp8():
    with LLM("tiny", **KW) as llm:
        first = _tokens(llm)
        _assert_fused_everywhere(llm)
        results = {"repeat": _tokens(llm)}
        llm.sleep(level=1)
        assert llm.is_sleeping()
        llm.wake_up()
        results["after L1"] = _tokens(llm)
        ptrs = llm.collective_rpc("data_ptrs")
        for cycle in (1, 2):
            reports = llm.sleep(level=2)
            assert all(r["level"] == 2 for r in reports)
            llm.wake_up(tags=["weights"])
            llm.wake_up(tags=["kv_cache"])
            results[f"after L2 #{cycle}"] = _tokens(llm)
        assert llm.collective_rpc("data_ptrs") == ptrs, "level-2 wake moved a tensor"
        _assert_fused_everywhere(llm)
    for name, toks in results.items():
        same = sum(a == b for a, b in zip(first, toks))
        assert same == 16, f"{name}: {same}/16 identical"


def test_negative_control_zeroed_flags_fails_fast():
    deadline = 3.0
    with LLM("tiny", tail_deadline_s=deadline, **KW) as llm:
        _tokens(llm)
        llm.sleep(level=2)
        llm.wake_up(tags=["weights"])
        llm.wake_up(tags=["kv_cache"])
        llm.collective_rpc("zero_tail_flags")
        t0 = time.monotonic()
        outs = llm.generate(_prompts(), GREEDY, timeout=120)
        elapsed = time.monotonic() - t0
    errors = [o.error for o in outs if o.error]
    assert errors, "zeroed flags gave no error: the test could not catch lost tail state"
    assert "TailTimeout" in errors[0] or "deadline" in errors[0], errors[0]
    assert elapsed < deadline + 30
