"""The seed's test plan (DESIGN §4) through the offline API on CPU, with its negative control, on the
DeepSeek-V3 latent look-alike at TP 2 (the TP-8 run is `latentserve verify-sleep` on Kimi-K3, in
test_server_verify_sleep.py: CI keeps one TP-8 end-to-end run)."""

from service import LLM, SamplingParams
from service.seed_plan import (
    check_control,
    control_then_serve,
    fused_everywhere,
    identical_counts,
    plan_prompts,
    run_plan,
)

TP = 2
GREEDY = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
KW = dict(tensor_parallel_size=TP, dtype="float32", hf_overrides={"num_hidden_layers": 4},
          enable_sleep_mode=True, sleep_preserve_parameter_names=["*"], fused_tail="auto")


def test_seed_plan_tp2():
    with LLM("tiny", **KW) as llm:
        runs = run_plan(llm, plan_prompts(), GREEDY)
        fused_everywhere(llm, TP, moe_layers=3)  # 4 layers, the first is dense
    assert identical_counts(runs) == {name: 16 for name in ("repeat", "after L1", "after L2 #1", "after L2 #2")}


def test_negative_control_zeroed_flags_fails_fast_then_serves_again():
    deadline = 3.0
    with LLM("tiny", tail_deadline_s=deadline, **KW) as llm:
        errors, elapsed, same = control_then_serve(llm, plan_prompts(), GREEDY)
    check_control(errors, elapsed, deadline)
    assert same == 16, f"after the failed step the ranks re-arm in place: {same}/16 prompts as before"
