"""Soak: level-2 sleep cycles with a weight update each, on TP ranks (Ray actors, CPU).

Each cycle: generate greedily, sleep(2) (parameters discarded), wake the weights, load them
again from a checkpoint on disk (a trainer's `path` update), wake the KV cache. Every cycle
must give the first cycle's tokens. Memory must not creep: the rank processes' RSS and the
bytes used in /dev/shm (tmpfs counts unlinked-but-mapped segments too) are sampled after each
cycle; the growth from cycle `--settle` to the last is printed as a fraction.

    python bench/soak.py --cycles 100 --tp 2 [--model k3-tiny]

Prints one line per cycle (progress) and a summary; exits 1 if tokens changed or a growth
exceeds --max-growth (default 1%).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from service import LLM, SamplingParams  # noqa: E402
from service.config import resolve_model  # noqa: E402
from service.weights import write_dummy_checkpoint  # noqa: E402

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = [{"prompt_token_ids": [5 + i, 17 + 3 * i, 40 + i, 99]} for i in range(4)]


def status_kib(pid: int, key: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


def rank_rss(llm: LLM) -> int:
    return sum(status_kib(p["pid"], "VmRSS") for p in llm.collective_rpc("ping"))


def rank_shm(llm: LLM) -> int:
    """Resident shared memory of the rank processes: their /dev/shm segments (TP collectives and
    fused tail, unlinked once mapped) and other shmem mappings. Per process, so other programs'
    segments on the box do not count."""
    return sum(status_kib(p["pid"], "RssShmem") for p in llm.collective_rpc("ping"))


def growth(samples: list[int], settle: int) -> float:
    base = samples[settle]
    return (samples[-1] - base) / max(base, 1)


def soak(cycles: int, tp: int = 2, model: str = "tiny", settle: int = 10, log=print) -> dict:
    """Runs the cycles; returns tokens per cycle, RSS and /dev/shm samples and their growth."""
    settle = min(settle, cycles - 1)
    with tempfile.TemporaryDirectory() as ckpt:
        cfg, _ = resolve_model(model)
        write_dummy_checkpoint(cfg, ckpt, seed=3, dtype=torch.float32)
        with LLM(ckpt, tensor_parallel_size=tp, dtype="float32", enable_sleep_mode=True) as llm:
            tokens, rss_samples, shm = [], [], []
            for cycle in range(cycles):
                t0 = time.perf_counter()
                outs = llm.generate(PROMPTS, GREEDY)
                tokens.append([o.outputs[0].token_ids for o in outs])
                llm.sleep(level=2)
                llm.wake_up(["weights"])
                llm.update_weights_from_path(ckpt)
                llm.wake_up(["kv_cache"])
                rss_samples.append(rank_rss(llm))
                shm.append(rank_shm(llm))
                log(f"cycle {cycle + 1}/{cycles}: {time.perf_counter() - t0:.2f}s, ranks RSS "
                    f"{rss_samples[-1] / 2**20:.1f} MiB, shared memory {shm[-1] / 2**20:.1f} MiB, "
                    f"tokens {'same' if tokens[-1] == tokens[0] else 'CHANGED'}")
    return {"tokens": tokens, "rss": rss_samples, "shm": shm, "same_tokens": all(t == tokens[0] for t in tokens),
            "rss_growth": growth(rss_samples, settle), "shm_growth": growth(shm, settle), "settle": settle}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cycles", type=int, default=100)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--settle", type=int, default=10, help="growth is measured from this cycle on")
    ap.add_argument("--max-growth", type=float, default=0.01)
    args = ap.parse_args()
    r = soak(args.cycles, args.tp, args.model, args.settle, log=lambda m: print(m, flush=True))
    print(f"\n{args.cycles} level-2 cycles with a weight update each, TP {args.tp}, {args.model}: tokens "
          f"{'identical every cycle' if r['same_tokens'] else 'CHANGED'}; from cycle {r['settle'] + 1}: "
          f"ranks RSS {r['rss_growth']:+.2%}, shared memory {r['shm_growth']:+.2%} (limit {args.max_growth:.0%})")
    ok = r["same_tokens"] and abs(r["rss_growth"]) <= args.max_growth and abs(r["shm_growth"]) <= args.max_growth
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
