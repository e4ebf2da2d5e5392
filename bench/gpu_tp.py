"""TP 2 decode step time on one GPU: CUDA graphs (device collectives + fused tail inside) vs eager.

Two rank processes (the `mp` executor) share one GPU, so every wait on a peer costs a context
time slice: the numbers say what graphs change at TP 2 on this setup, not what TP 2 on two GPUs
costs. Both modes run in the same invocation, on the same model and prompts. A decode step's time
is (generate with N new tokens - generate with 1) / (N - 1), best of --rounds.
    python3 bench/gpu_tp.py --batch 1,8,64 --tokens 16
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from service import LLM, SamplingParams  # noqa: E402

OVERRIDES = dict(kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, initializer_range=0.1)


def timed(llm: LLM, prompts, n: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return time.perf_counter() - t0


def step_ms(llm: LLM, batch: int, tokens: int, rounds: int) -> float:
    rng = random.Random(batch)
    prompts = [[rng.randrange(4, 1000) for _ in range(8)] for _ in range(batch)]
    timed(llm, prompts, 2)  # warm-up: first prefill and decode shapes
    best = float("inf")
    for _ in range(rounds):
        full, one = timed(llm, prompts, tokens), timed(llm, prompts, 1)
        best = min(best, (full - one) / (tokens - 1) * 1e3)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--batch", default="1,8,64")
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tp", type=int, default=2)
    args = ap.parse_args()
    batches = [int(b) for b in args.batch.split(",")]
    rows = {}
    for mode in ("graphs", "eager"):
        t0 = time.perf_counter()
        llm = LLM(model=args.model, hf_overrides=OVERRIDES if args.model == "tiny" else None, dtype="bfloat16",
                  device="cuda", seed=0, tensor_parallel_size=args.tp, distributed_executor_backend="mp",
                  enforce_eager=mode == "eager", max_num_seqs=max(64, max(batches)))
        try:
            start_s = time.perf_counter() - t0
            graphs = llm.collective_rpc("graph_stats")[0]["graphs"]
            if (graphs is None) != (mode == "eager"):
                raise SystemExit(f"{mode}: decode graphs {'missing' if graphs is None else 'present'}")
            rows[mode] = {b: round(step_ms(llm, b, args.tokens, args.rounds), 2) for b in batches}
            print(f"{mode}: start {start_s:.0f}s, decode ms/step {rows[mode]}", flush=True)
        finally:
            llm.shutdown()
    print("batch | graphs ms | eager ms | eager/graphs")
    for b in batches:
        g, e = rows["graphs"][b], rows["eager"][b]
        print(f"{b} | {g} | {e} | {e / g:.2f}")
    print(json.dumps({"tp": args.tp, "model": args.model, "tokens": args.tokens, "ms_per_step": rows}))


if __name__ == "__main__":
    main()
