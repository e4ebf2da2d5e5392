"""The seed's test plan (DESIGN §4) on an offline `LLM`: the same checks `latentserve
verify-sleep` makes over HTTP, for any executor and device (the CPU tests, the GPU box).

The LLM needs sleep mode with every parameter preserved, so level 2 keeps the weights and
greedy tokens must come out identical after every cycle.
"""

from __future__ import annotations

import random
import time

from .llm import LLM
from .sampling_params import SamplingParams


def plan_prompts(n: int = 16, seed: int = 7, vocab: int = 1024) -> list[dict]:
    """Short random token-id prompts (ids 2..vocab-1), the same on every call."""
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(2, vocab) for _ in range(rng.randrange(4, 12))]} for _ in range(n)]


def greedy_tokens(llm: LLM, prompts: list[dict], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def fused_everywhere(llm: LLM, tp: int, moe_layers: int) -> None:
    """Every rank has `moe_layers` fused tail runners, and each has taken the fused path."""
    state = llm.collective_rpc("tail_state")
    assert len(state) == tp, f"{len(state)} ranks answered, expected {tp}"
    for rank_layers in state:
        assert len(rank_layers) == moe_layers, rank_layers
        assert all(layer["fused"] and layer["fused_calls"] > 0 for layer in rank_layers), rank_layers


def run_plan(llm: LLM, prompts: list[dict], params: SamplingParams) -> dict[str, list[list[int]]]:
    """Greedy tokens before sleep (twice), after level 1 and after two level-2 cycles; checks
    that level-2 wakes keep every tensor's address. Returns the runs by name, "first" included."""
    runs = {"first": greedy_tokens(llm, prompts, params), "repeat": greedy_tokens(llm, prompts, params)}
    llm.sleep(level=1)
    assert llm.is_sleeping()
    llm.wake_up()
    runs["after L1"] = greedy_tokens(llm, prompts, params)
    ptrs = llm.collective_rpc("data_ptrs")
    for cycle in (1, 2):
        reports = llm.sleep(level=2)
        assert all(r["level"] == 2 for r in reports)
        llm.wake_up(tags=["weights"])
        llm.wake_up(tags=["kv_cache"])
        runs[f"after L2 #{cycle}"] = greedy_tokens(llm, prompts, params)
    assert llm.collective_rpc("data_ptrs") == ptrs, "level-2 wake moved a tensor"
    return runs


def identical_counts(runs: dict[str, list[list[int]]]) -> dict[str, int]:
    first = runs["first"]
    return {name: sum(a == b for a, b in zip(first, toks)) for name, toks in runs.items() if name != "first"}


def control_then_serve(llm: LLM, prompts: list[dict], params: SamplingParams) -> tuple[list[str], float, int]:
    """The negative control: zero the tail's flags after the first level-2 wake; the next
    generation must fail. Then one more with no restart (the ranks re-armed in place). Returns
    (the failed requests' errors, seconds the failing generation took, prompts whose tokens
    afterwards equal those before the control)."""
    before = greedy_tokens(llm, prompts, params)
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    llm.wake_up(tags=["kv_cache"])
    llm.collective_rpc("zero_tail_flags")
    t0 = time.monotonic()
    outs = llm.generate(prompts, params, timeout=120)
    errors, elapsed = [o.error for o in outs if o.error], time.monotonic() - t0
    after = greedy_tokens(llm, prompts, params)
    return errors, elapsed, sum(a == b for a, b in zip(before, after))


def check_control(errors: list[str], elapsed: float, deadline_s: float) -> None:
    """The control failed as it must: a tail deadline error, within the deadline plus slack."""
    assert errors, "zeroed flags gave no error: the test could not catch lost tail state"
    assert "TailTimeout" in errors[0] or "deadline" in errors[0], errors[0]
    assert elapsed < deadline_s + 30, f"the failure took {elapsed:.1f}s"
