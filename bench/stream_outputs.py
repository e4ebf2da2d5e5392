"""What the engine's per-step outputs cost the host when every request is a stream (the HTTP
controller's case): LLMEngine.step() with a model that costs nothing, plus pickling and
unpickling its outputs as the rank-0 pipe does, with progress outputs as deltas
(`progress_deltas`, what the engine loop uses) against whole outputs, in the same run.

    python bench/stream_outputs.py [--streams 256] [--prompt-len 4096] [--steps 128] [--vocab 32768]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from service.engine.llm_engine import LLMEngine  # noqa: E402
from service.sampling_params import SamplingParams  # noqa: E402
from service.tokenizer import build_tiny_tokenizer  # noqa: E402


def run(args, deltas: bool) -> dict:
    tok = build_tiny_tokenizer(args.vocab)
    logits = torch.randn(args.streams, args.vocab, generator=torch.Generator().manual_seed(0))

    def free_model(plan):  # logits for each chunk that needs them, at no model cost
        return logits[:sum(c.needs_logits for c in plan.chunks)]

    block = 16
    per_seq = -(-(args.prompt_len + args.steps) // block)
    engine = LLMEngine(free_model, tok, block_size=block, num_blocks=args.streams * per_seq + 16,
                       max_num_seqs=args.streams, max_num_batched_tokens=args.streams * args.prompt_len,
                       max_model_len=args.prompt_len + args.steps, vocab_size=args.vocab)
    engine.progress_deltas = deltas
    params = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
    for i in range(args.streams):
        engine.add_request(f"r{i}", None, [5 + (i + j) % 1000 for j in range(args.prompt_len)], params)
    engine.step()  # the prefill
    step_s = pipe_s = 0.0
    nbytes = steps = 0
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        t1 = time.perf_counter()
        blob = pickle.dumps(outs)
        pickle.loads(blob)
        step_s += t1 - t0
        pipe_s += time.perf_counter() - t1
        nbytes += len(blob)
        steps += 1
    return {"steps": steps, "step_ms": step_s / steps * 1e3, "pipe_ms": pipe_s / steps * 1e3,
            "bytes_per_step": nbytes / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--steps", type=int, default=128, help="output tokens per stream")
    ap.add_argument("--vocab", type=int, default=32768)
    args = ap.parse_args()
    whole, delta = run(args, False), run(args, True)
    total = lambda r: r["step_ms"] + r["pipe_ms"]  # noqa: E731
    out = {"args": vars(args), "whole": whole, "delta": delta, "ratio": total(whole) / total(delta)}
    print(json.dumps(out))
    print(f"{args.streams} streams, prompt {args.prompt_len}, {args.steps} tokens out: host ms a step (engine step + "
          f"pipe) {total(delta):.1f} with deltas, {total(whole):.1f} with whole outputs: {out['ratio']:.1f}x; "
          f"{delta['bytes_per_step'] / 1e3:.0f} vs {whole['bytes_per_step'] / 1e3:.0f} kB a step")


if __name__ == "__main__":
    main()
