"""The step plan's trip from rank 0 to the other TP ranks, on the host: encoding on rank 0 and
decoding on a follower, both on a TP > 1 step's critical path. Block-table deltas (`PlanCodec`,
what the workers use) against whole tables (`encode_message` / `decode_message`, the format
before), in the same run, over decode steps of `--streams` sequences whose contexts grow from
`--context` tokens.

    python bench/plan_codec.py [--streams 64,256] [--context 1024] [--steps 64] [--block-size 16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from service.engine.plan import PlanCodec, SeqChunk, StepPlan, decode_message, encode_message  # noqa: E402


def plans(streams: int, context: int, steps: int, block_size: int) -> list[StepPlan]:
    """Decode steps as the scheduler makes them: each chunk's table a fresh copy, a block more
    whenever a sequence crosses into one; contexts staggered so crossings spread over steps."""
    out = []
    for k in range(steps):
        chunks = []
        for i in range(streams):
            pos = context + i + k
            base = i * (context + streams + steps) // block_size
            chunks.append(SeqChunk(i, [7], pos, list(range(base, base + pos // block_size + 1)), True, i))
        out.append(StepPlan(chunks))
    return out


def time_steps(steps: list[StepPlan], deltas: bool) -> tuple[float, float, int]:
    """Mean ms to encode and to decode a step, and the last message's ints."""
    enc, dec = PlanCodec(), PlanCodec()
    encode = enc.encode if deltas else (lambda p: encode_message("step", p))
    decode = dec.decode if deltas else decode_message
    te = td = 0.0
    for p in steps:
        t0 = time.perf_counter()
        msg = encode(p)
        t1 = time.perf_counter()
        decode(msg)
        td += time.perf_counter() - t1
        te += t1 - t0
    return te / len(steps) * 1e3, td / len(steps) * 1e3, int(msg.size)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", default="64,256")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    summary = {}
    for n in (int(x) for x in args.streams.split(",")):
        steps = plans(n, args.context, args.steps, args.block_size)
        runs = {"whole": [], "deltas": []}
        for r in range(args.rounds):
            for name in runs:  # alternating, so drift hits both
                runs[name].append(time_steps(steps, name == "deltas"))
            print(f"[plan-codec] {n} streams, round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
        med = {name: {"encode_ms": statistics.median(x[0] for x in rs), "decode_ms": statistics.median(x[1] for x in rs),
                      "ints": rs[-1][2]} for name, rs in runs.items()}
        ratio = ((med["whole"]["encode_ms"] + med["whole"]["decode_ms"])
                 / (med["deltas"]["encode_ms"] + med["deltas"]["decode_ms"]))
        for name, m in med.items():
            print(f"{n:4d} streams {name:6s}: encode {m['encode_ms']:.3f} ms, decode {m['decode_ms']:.3f} ms, "
                  f"{m['ints']} ints a step")
        print(f"{n:4d} streams: encode + decode {ratio:.2f}x faster with deltas")
        summary[n] = med | {"whole_over_deltas": ratio}
    print("SUMMARY " + json.dumps({"args": vars(args), "results": summary}))


if __name__ == "__main__":
    main()
