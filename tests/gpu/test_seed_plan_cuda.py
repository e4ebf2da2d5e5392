"""The seed's test plan (DESIGN §4) on one GPU at TP 2: two rank processes share the device
(`distributed_executor_backend="mp"`, no Ray), their fused tails map each other's comm memory
through cuMem FDs, and the flags and peer tables live in the cuMem weights pool.

Identical greedy tokens before sleep (twice), after level 1 and after two level-2 cycles, the
fused path confirmed on every rank, addresses unchanged; negative control: zeroed flags after a
level-2 wake end in the tail's deadline error.
"""

from __future__ import annotations

import random
import time

import pytest
import torch

from service import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

TP = 2
OVERRIDES = dict(kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
                 initializer_range=0.1, num_hidden_layers=4)
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
KW = dict(tensor_parallel_size=TP, dtype="bfloat16", device="cuda", hf_overrides=OVERRIDES,
          distributed_executor_backend="mp", enable_sleep_mode=True, sleep_preserve_parameter_names=["*"],
          fused_tail="on")


def _prompts():
    rng = random.Random(7)
    return [{"prompt_token_ids": [rng.randrange(2, 1024) for _ in range(rng.randrange(4, 12))]} for _ in range(16)]


def _tokens(llm):
    return [o.outputs[0].token_ids for o in llm.generate(_prompts(), GREEDY)]


def _assert_fused_everywhere(llm):
    state = llm.collective_rpc("tail_state")
    assert len(state) == TP
    for rank_layers in state:
        assert len(rank_layers) == 3  # 4 layers, the first is dense
        assert all(layer["fused"] and layer["fused_calls"] > 0 for layer in rank_layers), rank_layers


def test_seed_plan_tp2_on_one_gpu():
    with LLM("tiny", **KW) as llm:
        t0 = time.perf_counter()
        first = _tokens(llm)
        print(f"\nTP 2 on one GPU: 16 prompts x 32 tokens in {time.perf_counter() - t0:.2f}s")
        _assert_fused_everywhere(llm)
        assert len({p["pid"] for p in llm.collective_rpc("ping")}) == TP
        assert all(r["device"].startswith("cuda") for r in llm.collective_rpc("memory_report"))
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
