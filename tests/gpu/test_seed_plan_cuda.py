"""The seed's test plan (DESIGN §4) on one GPU at TP 2: two rank processes share the device
(`distributed_executor_backend="mp"`, no Ray), their fused tails map each other's comm memory
through cuMem FDs, and the flags and peer tables live in the cuMem weights pool.

Identical greedy tokens before sleep (twice), after level 1 and after two level-2 cycles, the
fused path confirmed on every rank, addresses unchanged; negative control: zeroed flags after a
level-2 wake end in the tail's deadline error, then the ranks re-arm and serve the same tokens.
"""

from __future__ import annotations

import time

import pytest
import torch
from kernel_env import GRAPH_SHAPES

from service import LLM, SamplingParams
from service.seed_plan import (
    check_control,
    control_then_serve,
    fused_everywhere,
    greedy_tokens,
    identical_counts,
    plan_prompts,
    run_plan,
)

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

TP = 2
# Widths the Triton MLA decode kernel takes (powers of two), larger weights so greedy is not flat.
OVERRIDES = {**GRAPH_SHAPES, "num_hidden_layers": 4}
# The seed's model: Kimi-K3 (KDA layers through the fla kernels, MLA, latent MoE, attention residuals).
MODELS = ["tiny", "k3-tiny"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
KW = dict(tensor_parallel_size=TP, dtype="bfloat16", device="cuda", hf_overrides=OVERRIDES,
          distributed_executor_backend="mp", enable_sleep_mode=True, sleep_preserve_parameter_names=["*"],
          fused_tail="on")


@pytest.mark.parametrize("model", MODELS)
def test_seed_plan_tp2_on_one_gpu(model):
    with LLM(model, **KW) as llm:
        t0 = time.perf_counter()
        greedy_tokens(llm, plan_prompts(), GREEDY)
        print(f"\nTP 2 on one GPU: 16 prompts x 32 tokens in {time.perf_counter() - t0:.2f}s")
        assert len({p["pid"] for p in llm.collective_rpc("ping")}) == TP
        assert all(r["device"].startswith("cuda") for r in llm.collective_rpc("memory_report"))
        runs = run_plan(llm, plan_prompts(), GREEDY)
        fused_everywhere(llm, TP, moe_layers=3)  # 4 layers, the first is dense
    assert identical_counts(runs) == {name: 16 for name in ("repeat", "after L1", "after L2 #1", "after L2 #2")}


@pytest.mark.parametrize("model", MODELS)
def test_negative_control_zeroed_flags_fails_fast_then_serves_again(model):
    deadline = 3.0
    with LLM(model, tail_deadline_s=deadline, **KW) as llm:
        errors, elapsed, same = control_then_serve(llm, plan_prompts(), GREEDY)
    check_control(errors, elapsed, deadline)
    assert same == 16, f"after the failed step the ranks re-arm in place: {same}/16 prompts as before"
