"""HTTP serving benchmark: concurrent streaming clients, then the controller's sleep/wake overhead.

    .venv/bin/python bench/serve.py [--model tiny --tp 2 | --url http://127.0.0.1:8000 --admin-key K]
        [--clients 8] [--requests 64] [--duration 120] [--prompt-len 16] [--max-tokens 32]
        [--cycles 5] [--json out.json]

Starts `latentserve serve` on loopback (sleep mode on, every parameter preserved so level 2
needs no weight update) unless --url is given; only loopback URLs are accepted. Load phase:
`--clients` concurrent streaming clients send greedy token-id prompts until `--requests` are
done or `--duration` seconds pass. Reports throughput, time to first token (TTFT), inter-token
latency (ITL, per token: the gap between token-bearing chunks divided by their tokens) and
end-to-end latency percentiles. Then `--cycles` level-1 and level-2 sleep/wake cycles: the
controller's overhead is the HTTP round trip minus the slowest rank's own reported seconds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from urllib.parse import urlparse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from service.client import AsyncClient, Client  # noqa: E402
from service.server.launch import start_healthy  # noqa: E402


def log(msg: str) -> None:
    print(f"[serve-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def one_request(c: AsyncClient, prompt: list[int], max_tokens: int) -> dict:
    start = time.perf_counter()
    first, last, itl, tokens = None, None, [], 0
    async for chunk in c.stream_completions([prompt], max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
        n = sum(len(ch.get("token_ids", [])) for ch in chunk.get("choices", []))
        if not n:
            continue
        now = time.perf_counter()
        if first is None:
            first = now
        else:
            itl.extend([(now - last) / n] * n)
        last, tokens = now, tokens + n
    return {"ttft": first - start, "e2e": time.perf_counter() - start, "itl": itl, "tokens": tokens}


async def load_phase(url: str, clients: int, requests: int, duration: float, prompt_len: int,
                     max_tokens: int) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 256) for _ in range(prompt_len)] for _ in range(requests)]
    results: list[dict] = []
    errors: list[str] = []
    issued = 0
    stop_at = time.perf_counter() + duration

    async def client_loop(c: AsyncClient) -> None:
        nonlocal issued
        while issued < requests and time.perf_counter() < stop_at:
            prompt = prompts[issued]
            issued += 1
            try:
                results.append(await one_request(c, prompt, max_tokens))
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")

    async with AsyncClient(url, timeout=600.0) as c:
        await one_request(c, prompts[0], 4)  # warm-up
        t0 = time.perf_counter()
        await asyncio.gather(*(client_loop(c) for _ in range(clients)))
        wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in results)
    itl = [x for r in results for x in r["itl"]]
    summary = {"clients": clients, "requests": len(results), "errors": len(errors), "wall_s": wall,
               "output_tokens": tokens, "tokens_per_s": tokens / wall, "requests_per_s": len(results) / wall}
    for name, xs in (("ttft", [r["ttft"] for r in results]), ("itl", itl), ("e2e", [r["e2e"] for r in results])):
        summary[name] = {f"p{q}": pct(xs, q) for q in (50, 90, 99)}
    if errors:
        summary["first_error"] = errors[0]
    return summary


def rank_seconds(report: dict) -> float:
    return max((r["result"] or {}).get("seconds", 0.0) for r in report["ranks"] if r.get("result") is not None)


def sleep_wake_overhead(c: Client, cycles: int) -> dict:
    ops: dict[str, list[tuple[float, float]]] = {}

    def timed(name: str, fn, *args) -> None:
        t0 = time.perf_counter()
        report = fn(*args)
        rtt = time.perf_counter() - t0
        ops.setdefault(name, []).append((rtt, rank_seconds(report)))

    for _ in range(cycles):
        timed("sleep(1)", c.sleep, 1)
        timed("wake_up()", c.wake_up)
        timed("sleep(2)", c.sleep, 2)
        timed("wake_up(weights)", c.wake_up, ["weights"])
        timed("wake_up(kv_cache)", c.wake_up, ["kv_cache"])
    out = {}
    for name, xs in ops.items():
        out[name] = {"http_s": statistics.median(x[0] for x in xs), "ranks_s": statistics.median(x[1] for x in xs),
                     "overhead_s": statistics.median(x[0] - x[1] for x in xs)}
    return out


def print_report(load: dict, overhead: dict, args) -> None:
    print(f"\nLoad: {load['clients']} clients, {load['requests']} requests x {args.max_tokens} tokens "
          f"(prompt {args.prompt_len}), {load['errors']} errors, {load['wall_s']:.1f} s")
    print(f"throughput: {load['tokens_per_s']:.1f} output tokens/s, {load['requests_per_s']:.2f} requests/s\n")
    print("| metric | p50 | p90 | p99 |\n|---|---:|---:|---:|")
    for name, label in (("ttft", "time to first token (ms)"), ("itl", "inter-token latency (ms)"),
                        ("e2e", "request latency (ms)")):
        row = load[name]
        print(f"| {label} | {row['p50'] * 1e3:.1f} | {row['p90'] * 1e3:.1f} | {row['p99'] * 1e3:.1f} |")
    print("\n| op (median of cycles) | HTTP round trip (ms) | slowest rank (ms) | controller overhead (ms) |")
    print("|---|---:|---:|---:|")
    for name, row in overhead.items():
        print(f"| {name} | {row['http_s'] * 1e3:.1f} | {row['ranks_s'] * 1e3:.1f} | {row['overhead_s'] * 1e3:.1f} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url")
    p.add_argument("--admin-key", default=os.environ.get("LATENTSERVE_ADMIN_KEY"))
    p.add_argument("--model", default="tiny")
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--duration", type=float, default=120.0)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--cycles", type=int, default=5)
    p.add_argument("--json")
    args = p.parse_args()
    server = None
    if args.url:
        if urlparse(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
            p.error("loopback URLs only (this benchmark floods the server)")
        url, key = args.url, args.admin_key
    else:
        log(f"starting {args.model} TP {args.tp}")
        server, seconds = start_healthy(["--model", args.model, "--tp", str(args.tp), "--enable-sleep-mode",
                                         "--sleep-preserve-parameter-names", "*",
                                         "--max-num-seqs", str(max(64, args.clients))])
        log(f"ready in {seconds:.1f} s (log {server.log_path})")
        url, key = server.url, server.admin_key
    try:
        load = asyncio.run(load_phase(url, args.clients, args.requests, args.duration, args.prompt_len,
                                      args.max_tokens))
        overhead = {}
        if key and args.cycles:
            with Client(url, key) as c:
                overhead = sleep_wake_overhead(c, args.cycles)
    finally:
        if server is not None:
            server.stop()
    print_report(load, overhead, args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load": load, "sleep_wake": overhead, "args": vars(args)}, f, indent=2)
    return 0 if not load["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
