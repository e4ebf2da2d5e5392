"""Kimi-K3 (`k3-tiny`: KDA + MLA layers, latent MoE, SiTU, attention residuals) decoding through the
CUDA graphs on the GPU: greedy tokens equal to the eager CUDA engine, with padding rows (3
sequences replaying the graph of 4), sequences finishing and starting mid-run (a one-token
prompt's first step is a decode at position 0 on a state row another sequence left dirty), and
level-1 / level-2 sleep cycles replaying the graphs captured once.

Divergences are allowed only at near-ties of the reference (its top-2 logprob margin below the
run's measured noise), as in test_engine_cuda.py.
"""

from __future__ import annotations

import pytest
import torch

from service import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(900)]
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from kernel_env import GRAPH_SHAPES, k3_decode_kernels  # noqa: E402
from test_engine_cuda import compare, cycle_checks, graphs, tokens  # noqa: E402

# MLA widths the Triton decode kernel takes; weights large enough for clear greedy margins.
OVERRIDES = GRAPH_SHAPES
SIZES = [1, 2, 4]  # fp32 graphs need every batch within the Triton GEMV experts (16 tokens)


def _prompt(n: int, seed: int) -> list[int]:
    return [(seed * 131 + 17 * j) % 1000 + 4 for j in range(n)]


# (prompt length, max tokens): 4 run at once (max_num_seqs=4); B and D finish early and the
# one-token prompts E and F take their state slots, starting with a decode-shaped step at
# position 0 inside a graph; at the end 3, 2, then 1 sequence replay the graphs of 4, 2, 1.
REQUESTS = [(20, 24), (7, 6), (1, 24), (30, 10), (1, 14), (1, 9)]
PROMPTS = [_prompt(n, i) for i, (n, _) in enumerate(REQUESTS)]
PARAMS = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True, logprobs=2) for _, m in REQUESTS]


def make_llm(dtype: str, eager: bool = False, **kw) -> LLM:
    # The LATENTSERVE_* switches are read while dynamo traces and it does not guard on them: without
    # the reset a build would replay the compiled layers of the one before, switched otherwise.
    torch._dynamo.reset()
    return LLM(model="k3-tiny", hf_overrides=OVERRIDES, dtype=dtype, device="cuda", seed=0,
               distributed_executor_backend="uni", max_num_seqs=4, cuda_graph_batch_sizes=SIZES,
               enforce_eager=eager, **kw)


def generate(llm: LLM):
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
    return [o.outputs[0] for o in outs]


@pytest.fixture(scope="module")
def eager_fp32():
    with pytest.MonkeyPatch.context() as mp:
        k3_decode_kernels(mp, on=True)  # the defaults, whatever the caller's environment
        llm = make_llm("float32", eager=True)
        try:
            assert graphs(llm) is None
            return generate(llm)
        finally:
            llm.shutdown()


def spy_replays(g) -> list[tuple[int, int, int]]:
    """(rows, graph size, fresh rows) of every step the graphs ran."""
    seen = []
    run = g.run

    def spied(chunks):
        out = run(chunks)
        if out is not None:
            seen.append((len(chunks), g.batch_for(len(chunks)), sum(c.start_pos == 0 for c in chunks)))
        return out

    g.run = spied
    return seen


# K3's decode kernels, on by default since run 61: the KDA step as one kernel, the input projections
# as one launch, the attention-residual mixes as one kernel each, MLA's output gate in W_UV's kernel.
# `fla` turns them off: FLA's recurrent kernel and the torch chains the defaults replaced.
# Runs 55-56 (2026-12-05, H100): in graphs the KDA step kernel diverged from eager at every prompt's
# first decode token; the compiled layer had handed it a misplaced copy of its state
# (kda_step._outside_compile, run 57). Since the fix all four pass, with PDL and without.
BUILDS = ("defaults", "fla")
# fp32 logprobs of two kernel sets differ by up to ~1.2e-3 eagerly, no graphs involved (run 63: 1.21e-3
# between the step kernel alone and all four; run 64: 2.7e-4 between `fla` and the defaults): sums
# in another order through 24 tokens of recurrent state. A build's graphs against its own eager
# run stay below 1e-3 (runs 57-64: 0.07-0.8e-3).
CASES = ([("float32", 1e-3, 1e-3, "defaults"), ("float32", 1e-3, 3e-3, "fla")]
         + [("bfloat16", 1e-2, 0.5, build) for build in BUILDS])


def test_k3_fla_eager_matches_the_defaults(eager_fp32, monkeypatch):
    """The two builds without graphs or compiled layers: where test_k3_greedy_in_graphs_matches_eager
    fails and this passes, the fault is in a capture, not a kernel."""
    k3_decode_kernels(monkeypatch, on=False)
    llm = make_llm("float32", eager=True)
    try:
        outs = generate(llm)
    finally:
        llm.shutdown()
    rep = compare(eager_fp32, outs, 1e-3)
    print(f"\nfp32 eager fla vs fp32 eager defaults: noise {rep['noise']:.2e}, divergences {rep['divergences']}")
    assert not rep["unexplained"], f"divergences at clear margins: {rep['unexplained']}"


@pytest.mark.parametrize("dtype,floor,max_noise,build", CASES, ids=[f"{d}-{b}" for d, _, _, b in CASES])
def test_k3_greedy_in_graphs_matches_eager(eager_fp32, dtype, floor, max_noise, build, monkeypatch):
    k3_decode_kernels(monkeypatch, on=build == "defaults")
    llm = make_llm(dtype)
    try:
        g = graphs(llm)
        assert g is not None, "k3-tiny decodes eagerly: the graphs were not captured (see cuda_graphs_off)"
        seen = spy_replays(g)
        outs = generate(llm)
        stats = g.stats()
    finally:
        llm.shutdown()
    print(f"\n{dtype}: graph steps (rows, size, fresh) {seen}; compiled layers {stats['compiled_layers']}")
    assert any(rows < size for rows, size, _ in seen), "no step ran with padding rows"
    assert any(fresh for _, _, fresh in seen), "no sequence started inside a graph (fresh state row)"
    assert any(rows == 3 and size == 4 for rows, size, _ in seen), "no batch of 3 replayed the graph of 4"
    rep = compare(eager_fp32, outs, floor)
    print(f"{dtype} graphs vs fp32 eager: noise {rep['noise']:.2e}, tol {rep['tol']:.2e}, divergences {rep['divergences']}")
    assert rep["noise"] < max_noise, f"logprobs differ from the eager engine by {rep['noise']:.3f}: not rounding"
    assert not rep["unexplained"], f"divergences at clear margins: {rep['unexplained']}"
    if dtype == "float32":
        assert len(rep["divergences"]) <= 1, f"fp32 parts at more than one near-tie: {rep['divergences']}"


def test_k3_sleep_cycles_replay_the_graphs_captured_once():
    llm = make_llm("bfloat16", enable_sleep_mode=True, sleep_preserve_parameter_names=["*"])
    try:
        base = tokens(generate(llm))
        ptrs = llm.collective_rpc("data_ptrs")[0]
        graph_ids = graphs(llm).stats()["graph_ids"]
        llm.sleep(1)
        llm.wake_up()
        cycle_checks(llm, base, ptrs, graph_ids, "level 1", run=generate)
        report = llm.sleep(2)[0]
        assert report["weights_valid"], "every parameter is preserved: level 2 may drop only the KV cache"
        llm.wake_up()
        cycle_checks(llm, base, ptrs, graph_ids, "level 2", run=generate)
    finally:
        llm.shutdown()
