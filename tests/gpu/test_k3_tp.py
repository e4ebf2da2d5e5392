"""Kimi-K3 at TP 2 (two rank processes, the `mp` executor) with its four decode kernels, the
defaults since run 61 (the KDA step kernel on each rank's share of the heads, the one-launch
projections of sharded weights, the attention-residual mixes, MLA's gate in W_UV's kernel),
against the same model with them off: greedy tokens and their logprobs agree. On CUDA the decode
steps replay the graphs; on a CPU with Triton installed and TRITON_INTERPRET=1 the kernels run
interpreted in both ranks (2026-12-05: 4 prompts x 6 tokens, the same tokens, logprobs within 3e-6).
"""

from __future__ import annotations

from kernel_env import DEVICE, GRAPH_SHAPES, k3_decode_kernels, kernel_marks, require_kernel_device

require_kernel_device()

from service import LLM, SamplingParams  # noqa: E402

pytestmark = kernel_marks(1800)
OVERRIDES = GRAPH_SHAPES
# A one-token prompt starts on a decode-shaped step at position 0; the others prefill first.
PROMPTS = [[(i * 131 + 17 * j) % 1000 + 4 for j in range(n)] for i, n in enumerate([9, 3, 1, 12])]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)


def generate(monkeypatch, kernels_on: bool) -> list:
    k3_decode_kernels(monkeypatch, kernels_on)  # the rank processes inherit the environment
    graphs = {"cuda_graph_batch_sizes": [1, 2, 4]} if DEVICE == "cuda" else {}
    llm = LLM(model="k3-tiny", hf_overrides=OVERRIDES, dtype="float32", device=DEVICE, seed=0, tensor_parallel_size=2,
              distributed_executor_backend="mp", max_num_seqs=4, **graphs)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS)
        if DEVICE == "cuda":
            stats = llm.collective_rpc("graph_stats")
            assert all(s["graphs"] is not None and s["graphs"]["replays"] > 0 for s in stats), stats
    finally:
        llm.shutdown()
    return [o.outputs[0] for o in outs]


def test_k3_decode_kernels_at_tp2_match_them_off(monkeypatch):
    off = generate(monkeypatch, kernels_on=False)
    on = generate(monkeypatch, kernels_on=True)
    for i, (a, b) in enumerate(zip(off, on)):
        assert a.token_ids == b.token_ids, f"prompt {i}: {a.token_ids} with the kernels off, {b.token_ids} on"
        for j, t in enumerate(a.token_ids):
            # fp32: sums in another order (test_k3_graphs_cuda's `fla` build: up to 1.2e-3 over 24 tokens)
            assert abs(a.logprobs[j][t] - b.logprobs[j][t]) < 3e-3, (i, j, a.logprobs[j][t], b.logprobs[j][t])
