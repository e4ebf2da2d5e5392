"""How long a request that arrives while decoding runs waits for its prefill, counted in launches
(1: the very next step launched), with steps in order against async output. Over a simulated device
(`host_step.SimulatedDevice`: the sampler waits until a launched step's time is up) with
`--streams` sequences decoding, a thread adds `--arrivals` short requests at random moments.

Run 65 (H100, 256 HTTP streams) found async output's TTFT p50 31% above in order's: a request that
arrived while the next decode step was already scheduled ahead waited for the launch after it.

    python bench/admission.py [--streams 64] [--device-ms 5] [--arrivals 40] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import threading
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from host_step import SimulatedDevice  # noqa: E402  (bench/, this script's folder)

from service.engine.llm_engine import LLMEngine  # noqa: E402
from service.sampling_params import SamplingParams  # noqa: E402
from service.tokenizer import build_tiny_tokenizer  # noqa: E402

VOCAB = 2048
MARK = 1500  # an arrival's prompt starts with MARK + its index: its prefill chunk is found by it


def delays(args, overlap: bool, seed: int) -> list[int]:
    """Per arrival: launches from its add_request to the step that carries its prefill."""
    tok = build_tiny_tokenizer(VOCAB)
    rows = args.streams + args.arrivals
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0))
    launches, first = [0], {}
    device = SimulatedDevice(args.device_ms)

    def model(plan):
        launches[0] += 1
        for c in plan.chunks:
            if len(c.token_ids) > 1 and c.token_ids[0] >= MARK:
                first.setdefault(c.token_ids[0] - MARK, launches[0])
        device.launched()
        return logits[:sum(c.needs_logits for c in plan.chunks)]

    steps = int(args.arrivals * 3 * 1.5) + 16  # the decoding outlasts the arrivals
    engine = LLMEngine(model, tok, block_size=16, num_blocks=rows * (-(-(16 + steps) // 16)) + 16,
                       max_num_seqs=rows, max_num_batched_tokens=4096, max_model_len=16 + steps,
                       vocab_size=VOCAB, overlap=overlap)
    device.attach(engine)
    long = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
    for i in range(args.streams):
        engine.add_request(f"s{i}", None, [5 + (i + j) % 1000 for j in range(16)], long)
    for _ in range(3):
        engine.step()
    at_add: dict[int, int] = {}
    rng = random.Random(seed)

    def arrive():
        short = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        for i in range(args.arrivals):
            time.sleep(rng.uniform(1.0, 5.0) * args.device_ms / 1e3)
            at_add[i] = launches[0]
            engine.add_request(f"a{i}", None, [MARK + i] + [7] * 15, short)

    arrivals = threading.Thread(target=arrive)
    arrivals.start()
    while arrivals.is_alive() or len(first) < len(at_add):
        engine.step()
    arrivals.join()
    engine.abort_all()
    return [first[i] - at_add[i] for i in range(args.arrivals)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--device-ms", type=float, default=5.0)
    ap.add_argument("--arrivals", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    got: dict[str, list[int]] = {"in_order": [], "async_output": []}
    for r in range(args.rounds):
        for name in got:
            got[name] += delays(args, overlap=name == "async_output", seed=r)
        print(f"[admission] round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    summary = {}
    for name, d in got.items():
        summary[name] = {"mean": statistics.mean(d), "p90": sorted(d)[int(0.9 * (len(d) - 1))], "max": max(d),
                         "n": len(d)}
        print(f"{name:13s} launches to the prefill: mean {summary[name]['mean']:.2f}, p90 {summary[name]['p90']}, "
              f"max {summary[name]['max']} ({len(d)} arrivals)")
    ratio = summary["async_output"]["mean"] / summary["in_order"]["mean"]
    print(f"async output waits {ratio:.2f}x in order's launches ({args.streams} streams, device {args.device_ms:g} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "async_over_in_order": ratio}, f, indent=1)
    print("SUMMARY " + json.dumps({"summary": summary, "async_over_in_order": ratio}))


if __name__ == "__main__":
    main()
