"""How long a request that arrives while decoding runs waits for its prefill, counted in launches
(1: the very next step launched), and for its first token (ms), with steps in order against async
output. Over a simulated device (`host_step.SimulatedDevice`: the sampler waits until a launched
step's time is up) with `--streams` sequences decoding, a thread adds `--arrivals` short requests
at random moments, or in bursts (`--burst N`: N arrivals 0.2-1 steps apart, then a pause).
`--prefill-ms`: a launch that prefills holds the host that long, as a mixed step's does on a GPU.

Run 65 (H100, 256 HTTP streams) found async output's TTFT p50 31% above in order's: a request that
arrived while the next decode step was already scheduled ahead waited for the launch after it.
Run 69, with that mended: still +50%. A step's tokens were reported after the next launch, which
for a mixed step holds the host 34 ms; `async_unpublished` is that build, `async_output` the
engine loop's hand-over before a prefill launches (LLMEngine.publish).

    python bench/admission.py [--streams 64] [--device-ms 5] [--arrivals 40] [--burst 8]
                              [--prefill-ms 30] [--rounds 3] [--json out.json]
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


def delays(args, overlap: bool, publish: bool, seed: int) -> tuple[list[int], list[float]]:
    """Per arrival: launches from its add_request to the step that carries its prefill, and ms to
    its first token reported (published, or returned by step())."""
    tok = build_tiny_tokenizer(VOCAB)
    rows = args.streams + args.arrivals
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(0))
    launches, first = [0], {}
    device = SimulatedDevice(args.device_ms)

    def model(plan):
        launches[0] += 1
        prefills = False
        for c in plan.chunks:
            prefills |= len(c.token_ids) > 1
            if len(c.token_ids) > 1 and c.token_ids[0] >= MARK:
                first.setdefault(c.token_ids[0] - MARK, launches[0])
        if prefills and args.prefill_ms:
            time.sleep(args.prefill_ms / 1e3)
        device.launched()
        return logits[:sum(c.needs_logits for c in plan.chunks)]

    steps = int(args.arrivals * 3 * 1.5) + 16  # the decoding outlasts the arrivals
    engine = LLMEngine(model, tok, block_size=16, num_blocks=rows * (-(-(16 + steps) // 16)) + 16,
                       max_num_seqs=rows, max_num_batched_tokens=4096, max_model_len=16 + steps,
                       vocab_size=VOCAB, overlap=overlap)
    device.attach(engine)
    added: dict[str, float] = {}
    ttft: dict[str, float] = {}

    def reported(outs) -> bool:
        now = time.perf_counter()
        for o in outs:
            if o.request_id in added and o.outputs[0].token_ids and o.request_id not in ttft:
                ttft[o.request_id] = (now - added[o.request_id]) * 1e3
        return True

    engine.publish = reported if publish else None
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
            gap = (rng.uniform(0.2, 1.0) if i % args.burst else rng.uniform(4.0, 8.0)) if args.burst \
                else rng.uniform(1.0, 5.0)
            time.sleep(gap * args.device_ms / 1e3)
            at_add[i] = launches[0]
            added[f"a{i}"] = time.perf_counter()
            engine.add_request(f"a{i}", None, [MARK + i] + [7] * 15, short)

    arrivals = threading.Thread(target=arrive)
    arrivals.start()
    while arrivals.is_alive() or len(ttft) < len(at_add):
        reported(engine.step())
    arrivals.join()
    engine.abort_all()
    return [first[i] - at_add[i] for i in range(args.arrivals)], [ttft[f"a{i}"] for i in range(args.arrivals)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--device-ms", type=float, default=5.0)
    ap.add_argument("--arrivals", type=int, default=40)
    ap.add_argument("--burst", type=int, default=0)
    ap.add_argument("--prefill-ms", type=float, default=0.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    modes = {"in_order": (False, False), "async_unpublished": (True, False), "async_output": (True, True)}
    launches: dict[str, list[int]] = {m: [] for m in modes}
    ttft: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(args.rounds):
        for name, (overlap, publish) in modes.items():
            d, t = delays(args, overlap, publish, seed=r)
            launches[name] += d
            ttft[name] += t
        print(f"[admission] round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
    summary = {}
    for name in modes:
        d, t = launches[name], sorted(ttft[name])
        summary[name] = {"mean": statistics.mean(d), "p90": sorted(d)[int(0.9 * (len(d) - 1))], "max": max(d),
                         "n": len(d), "ttft_ms_p50": statistics.median(t), "ttft_ms_p90": t[int(0.9 * (len(t) - 1))]}
        print(f"{name:17s} launches to the prefill: mean {summary[name]['mean']:.2f}, p90 {summary[name]['p90']}, "
              f"max {summary[name]['max']}; first token p50 {summary[name]['ttft_ms_p50']:.1f} ms, "
              f"p90 {summary[name]['ttft_ms_p90']:.1f} ms ({len(d)} arrivals)")
    base = summary["in_order"]
    ratios = {name: {"launches": summary[name]["mean"] / base["mean"],
                     "ttft_p50": summary[name]["ttft_ms_p50"] / base["ttft_ms_p50"]} for name in modes}
    for name in ("async_unpublished", "async_output"):
        print(f"{name}: {ratios[name]['launches']:.2f}x in order's launches, first token p50 "
              f"{ratios[name]['ttft_p50']:.2f}x ({args.streams} streams, device {args.device_ms:g} ms, "
              f"prefill launch {args.prefill_ms:g} ms, burst {args.burst})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "summary": summary, "over_in_order": ratios}, f, indent=1)
    print("SUMMARY " + json.dumps({"summary": summary, "over_in_order": ratios}))

if __name__ == "__main__":
    main()
