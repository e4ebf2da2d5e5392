"""Kimi-K3 (`k3-tiny`: KDA and MLA layers, latent MoE, SiTU, attention residuals) through the
paged caches and the engine.

The reference is a cache-less full recompute of every sequence at every step: no KV blocks, no
KDA state rows. The paged runner and the engine (continuous batching, chunked prefill,
preemption by recompute, level-2 sleep dropping the state with the KV) must give its tokens.
"""

from __future__ import annotations

import pytest
from _model_utils import PagedRunner, assert_same_greedy, build_model, full_logits, greedy_full, prompts

from service import LLM, SamplingParams
from service.config import PRESETS

pytestmark = pytest.mark.usefixtures("one_thread")

CFG = PRESETS["k3-tiny"]
STEPS = 12
PROMPTS = prompts(6, CFG.vocab_size, seed=3, lo=3, hi=40)  # some cross the 64-token KDA chunk only with output
GREEDY = SamplingParams(temperature=0.0, max_tokens=STEPS, ignore_eos=True)


@pytest.fixture(scope="module")
def reference():
    model = build_model(CFG)
    runs = [greedy_full(lambda seq: full_logits(model, seq), p, STEPS) for p in PROMPTS]
    return [r[0] for r in runs], [r[1] for r in runs]


def test_reference_is_not_degenerate(reference):
    tokens, _ = reference
    assert len({tuple(t) for t in tokens}) > 1


def test_paged_caches_and_state_rows_match_full_recompute(reference):
    model = build_model(CFG)
    ours = PagedRunner(model, num_blocks=96, block_size=4).greedy(PROMPTS, STEPS, prefill_chunk=5)
    assert assert_same_greedy(*reference, ours) >= len(PROMPTS) - 1


def _generate(llm: LLM) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("engine_kw", [
    pytest.param(dict(), id="batched"),
    # 4-token chunks: every prompt is prefilled over several steps, continuing its state row.
    pytest.param(dict(max_num_batched_tokens=8), id="chunked-prefill"),
    # 14 blocks of 4 cannot hold 6 growing sequences: the newest are preempted and recomputed.
    pytest.param(dict(num_kv_blocks=14, block_size=4, max_model_len=56), id="preemption"),
])
def test_engine_matches_full_recompute(reference, engine_kw):
    kw = dict(dtype="float32", distributed_executor_backend="uni", max_num_seqs=4) | engine_kw
    with LLM("k3-tiny", **kw) as llm:
        ours = _generate(llm)
        stats = llm.executor.rank0.engine_stats()
    assert assert_same_greedy(*reference, ours) >= len(PROMPTS) - 1
    if "num_kv_blocks" in engine_kw:
        assert stats["preemptions"] > 0


def test_level2_sleep_drops_state_and_recomputes_identically(reference):
    with LLM("k3-tiny", dtype="float32", distributed_executor_backend="uni", enable_sleep_mode=True,
             sleep_preserve_parameter_names=["*"]) as llm:
        before = _generate(llm)
        llm.sleep(level=2)
        llm.wake_up(["weights"])
        llm.wake_up(["kv_cache"])
        after = _generate(llm)
        report = llm.collective_rpc("memory_report")[0]
        ptrs = llm.collective_rpc("data_ptrs")[0]
    assert after == before
    assert assert_same_greedy(*reference, before) >= len(PROMPTS) - 1
    # The KDA state rows live beside the MLA KV under the kv_cache tag, never in a weights chunk.
    def tag_of(ptr: int) -> str:
        return next(c["tag"] for c in report["chunks"] if c["address"] <= ptr < c["address"] + c["capacity"])

    kda = [name for name in ptrs if name.startswith("kda_state.")]
    assert len(kda) == 2 * len(CFG.kda_layers)
    assert {tag_of(ptrs[name]) for name in kda} == {"kv_cache"}
