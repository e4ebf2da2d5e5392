"""HTTP serving benchmark: concurrent streaming clients, the same engine offline for a ratio,
then the controller's sleep/wake overhead.

    .venv/bin/python bench/serve.py [--model tiny --tp 2 | --url http://127.0.0.1:8000 --admin-key K]
        [--clients 8[,64,...]] [--requests 64] [--duration 120] [--prompt-len 16] [--max-tokens 32]
        [--cycles 5] [--offline] [--json out.json]
    python3 bench/serve.py --device cuda [--clients 64,256]     # one H200: see bench/gpu_serve.sh

Starts `latentserve serve` on loopback unless --url is given; only loopback URLs are accepted.
On the CPU (default): sleep mode on, every parameter preserved so level 2 needs no weight update.
With `--device cuda`: TP 1 on the mp executor (no Ray on the GPU box), the `small` preset with
--layers layers in bf16, dummy weights drawn on the GPU, max_num_seqs and CUDA graphs up to the
largest --clients, no sleep mode; and --offline by default.

Load phase, once per --clients level: that many concurrent streaming clients (spread over
--client-procs processes, so parsing the streams is not the bottleneck) send greedy token-id
prompts until --requests (default: 4 per client on CUDA) are done or --duration seconds pass.
Reports output tokens/s, time to first token (TTFT), inter-token latency (ITL, per token: the
gap between token-bearing chunks divided by their tokens) and end-to-end latency percentiles.
--offline: after the server stops, the same engine (the same serve options through `service.LLM`)
generates the same prompts and lengths in waves of --clients; HTTP / offline output tokens/s is
what serving over HTTP costs. Then `--cycles` level-1 and level-2 sleep/wake cycles: the
controller's overhead is the HTTP round trip minus the slowest rank's own reported seconds.
--baseline-args '--async-output off': the same levels again on a second server started with
those extra options, in the same run, and the ratio of output tokens/s; NAME=VALUE words are that
server's environment (e.g. 'LATENTSERVE_PDL=0').
The last line is `SUMMARY {json}`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import re
import shlex
import statistics
import sys
import tempfile
import time
from urllib.parse import urlparse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench import server_profile  # noqa: E402
from service.client import AsyncClient, Client  # noqa: E402
from service.server.launch import start_healthy  # noqa: E402

# --device cuda: bench/gpu.py's decode model (small with 24 layers: 8.2 GB of bf16, latent MoE).
# Clients over 8 processes: with 4 (the default to run 96), 64 streams' chunk parsing in one process
# added ~30 ms to the clients' TTFT at 256 streams and cost 6% of the tokens/s (H100, 2026-12-06).
CUDA_DEFAULTS = {"model": "small", "tp": 1, "clients": "64,256", "prompt_len": 128, "max_tokens": 128,
                 "cycles": 0, "client_procs": 8, "layers": 24, "dtype": "bfloat16", "backend": "mp"}
CPU_DEFAULTS = {"model": "tiny", "tp": 2, "clients": "8", "prompt_len": 16, "max_tokens": 32, "cycles": 5,
                "client_procs": 1, "layers": None, "dtype": "auto", "backend": "ray"}


def log(msg: str) -> None:
    print(f"[serve-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def graph_sizes(max_batch: int) -> list[int]:
    """Decode batch sizes captured as CUDA graphs: powers of two up to the largest level (a batch
    runs in the smallest graph that holds it)."""
    sizes, b = [], 1
    while b < max_batch:
        sizes.append(b)
        b *= 2
    return sizes + [max_batch]


def server_args(args) -> list[str]:
    """`latentserve serve` options of the bench's engine (the offline baseline parses the same)."""
    out = ["--model", args.model, "--tp", str(args.tp), "--dtype", args.dtype, "--device", args.device,
           "--max-num-seqs", str(max(64, max(args.clients))), "--distributed-executor-backend", args.backend]
    overrides = {**json.loads(args.hf_overrides or "{}"), **({"num_hidden_layers": args.layers} if args.layers else {})}
    if overrides:
        out += ["--hf-overrides", json.dumps(overrides)]
    if args.device.startswith("cuda"):
        out += ["--dummy-weights", "device",
                "--cuda-graph-batch-sizes", ",".join(map(str, graph_sizes(max(args.clients)))),
                "--kv-cache-memory-gib", str(args.kv_cache_gib), "--max-num-batched-tokens", "8192",
                "--max-model-len", str(max(256, args.prompt_len + args.max_tokens))]
    else:
        out += ["--enable-sleep-mode", "--sleep-preserve-parameter-names", "*"]
    return out


def make_prompts(n: int, prompt_len: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 256) for _ in range(prompt_len)] for _ in range(n)]


# ---- load: streaming clients --------------------------------------------------------------------

async def one_request(c: AsyncClient, prompt: list[int], max_tokens: int) -> dict:
    start = time.monotonic()  # system-wide on Linux: comparable across client processes
    first, last, itl, tokens = None, None, [], 0
    async for chunk in c.stream_completions([prompt], max_tokens=max_tokens, temperature=0.0, ignore_eos=True):
        n = sum(len(ch.get("token_ids", [])) for ch in chunk.get("choices", []))
        if not n:
            continue
        now = time.monotonic()
        if first is None:
            first = now
        else:
            itl.extend([(now - last) / n] * n)
        last, tokens = now, tokens + n
    end = time.monotonic()
    return {"ttft": first - start, "e2e": end - start, "itl": itl, "tokens": tokens, "start": start, "end": end}


async def _clients(url: str, clients: int, prompts: list[list[int]], max_tokens: int, stop_at: float) -> dict:
    results: list[dict] = []
    errors: list[str] = []
    issued = 0

    async def client_loop(c: AsyncClient) -> None:
        nonlocal issued
        while issued < len(prompts) and time.monotonic() < stop_at:
            prompt = prompts[issued]
            issued += 1
            try:
                results.append(await one_request(c, prompt, max_tokens))
            except Exception as e:
                errors.append(f"{type(e).__name__}: {e}")

    cpu0, t0 = time.process_time(), time.monotonic()
    async with AsyncClient(url, timeout=600.0, max_connections=clients + 4) as c:
        await asyncio.gather(*(client_loop(c) for _ in range(clients)))
    # This process's share of a core: near 1.0, its own parsing delays the streams it times.
    cpu = (time.process_time() - cpu0) / max(time.monotonic() - t0, 1e-9)
    return {"results": results, "errors": errors, "cpu": cpu}


def _client_process(url: str, clients: int, prompts: list[list[int]], max_tokens: int, duration: float,
                    barrier, results) -> None:
    """One process's share of the clients: starts when every process (and the parent) is ready."""
    try:
        barrier.wait()
        results.put(asyncio.run(_clients(url, clients, prompts, max_tokens, time.monotonic() + duration)))
    except BaseException as e:  # the parent waits for one answer per process
        results.put({"results": [], "errors": [f"client process: {type(e).__name__}: {e}"]})


def split(n: int, parts: int) -> list[int]:
    """n as `parts` near-equal positive counts (fewer parts when n is small)."""
    parts = max(1, min(parts, n))
    return [n // parts + (i < n % parts) for i in range(parts)]


def load_phase(url: str, clients: int, prompts: list[list[int]], max_tokens: int, duration: float,
               procs: int) -> dict:
    """`clients` concurrent streams over `procs` processes, the prompts dealt round-robin."""
    shares = split(clients, procs)
    if len(shares) == 1:
        parts = [asyncio.run(_clients(url, clients, prompts, max_tokens, time.monotonic() + duration))]
    else:
        ctx = multiprocessing.get_context("spawn")  # never fork a process that may hold CUDA
        barrier, queue = ctx.Barrier(len(shares) + 1), ctx.Queue()
        procs_ = [ctx.Process(target=_client_process, daemon=True, args=(
            url, share, prompts[i::len(shares)], max_tokens, duration, barrier, queue))
            for i, share in enumerate(shares)]
        for proc in procs_:
            proc.start()
        barrier.wait(timeout=300)  # every process has imported and is ready: the clock starts together
        parts = [queue.get(timeout=duration + 900) for _ in procs_]
        for proc in procs_:
            proc.join(30)
    summary = summarize(clients, [r for p in parts for r in p["results"]], [e for p in parts for e in p["errors"]])
    summary["client_cpu"] = round(max(p.get("cpu", 0.0) for p in parts), 3)  # the busiest client process
    return summary


def summarize(clients: int, results: list[dict], errors: list[str]) -> dict:
    wall = (max(r["end"] for r in results) - min(r["start"] for r in results)) if results else float("nan")
    tokens = sum(r["tokens"] for r in results)
    itl = [x for r in results for x in r["itl"]]
    summary = {"clients": clients, "requests": len(results), "errors": len(errors), "wall_s": wall,
               "output_tokens": tokens, "tokens_per_s": tokens / wall if results else 0.0,
               "requests_per_s": len(results) / wall if results else 0.0}
    for name, xs in (("ttft", [r["ttft"] for r in results]), ("itl", itl), ("e2e", [r["e2e"] for r in results])):
        summary[name] = {f"p{q}": pct(xs, q) for q in (50, 90, 99)}
        summary[name]["mean"] = sum(xs) / len(xs) if xs else float("nan")  # beside the server's means
    # The first `clients` requests start together on new connections, a burst of prefills behind
    # them; the rest start as streams end. Their TTFT apart says whether the burst is the mean's excess.
    ordered = sorted(results, key=lambda r: r["start"])
    for name, part in (("ttft_first_wave", ordered[:clients]), ("ttft_after", ordered[clients:])):
        summary[name] = sum(r["ttft"] for r in part) / len(part) if part else float("nan")
    if errors:
        summary["first_error"] = errors[0]
    return summary


def step_phases(before: dict, after: dict) -> dict:
    """The engine's steps between two snapshots (`engine_stats` and rank 0's decode graph
    replays): how many of each kind and in graphs, and the mean milliseconds per step of each
    phase (LLMEngine.step_seconds)."""
    steps = after["steps"] - before["steps"]
    out = {"steps": steps, "kinds": {k: after["step_kinds"][k] - before["step_kinds"].get(k, 0)
                                     for k in after.get("step_kinds", {})}}
    for key in ("graph_replays", "prefill_replays", "steps_scheduled_ahead"):
        if after.get(key) is not None and before.get(key) is not None:
            out[key] = after[key] - before[key]
    for k, v in after.get("step_seconds", {}).items():
        out[f"{k}_ms"] = (v - before["step_seconds"].get(k, 0.0)) / max(1, steps) * 1e3
    # Mean execute ms per step of each kind in the window; the longest is over the engine's life.
    for k, v in after.get("execute_seconds_by_kind", {}).items():
        n = out["kinds"].get(k, 0)
        if n:
            total = v["total"] - before.get("execute_seconds_by_kind", {}).get(k, {}).get("total", 0.0)
            out[f"execute_{k}_ms"] = total / n * 1e3
            out[f"execute_{k}_max_ms"] = v["max"] * 1e3
    split = first_token_split(before, after)
    if split:
        out["first_token_ms"] = split
    if after.get("process_cpu_s") is not None and before.get("process_cpu_s") is not None:
        # The HTTP server process (controller, event loop, streams): ~1.0 is one core, saturated.
        out["api_cpu"] = round((after["process_cpu_s"] - before["process_cpu_s"]) / (after["at"] - before["at"]), 3)
    lag_a, lag_b = after.get("loop_lag"), before.get("loop_lag")
    if lag_a and lag_b and lag_a["samples"] > lag_b["samples"]:
        out["loop_lag_ms"] = round((lag_a["lag_s"] - lag_b["lag_s"]) / (lag_a["samples"] - lag_b["samples"]) * 1e3, 2)
    if after.get("handovers") and before.get("handovers"):
        out["handovers"] = {k: v - before["handovers"].get(k, 0) for k, v in after["handovers"].items()}
    return out


def first_token_split(before: dict, after: dict) -> dict | None:
    """Mean ms of a first token's parts in the window: the ASGI app's first sight of the request to
    its route's start (`http`: body read and validated), then to its add_request answered
    (`admit`), then in the engine queued until the step that samples it
    launches, launched to landed on the host, landed to handed to the readers, and the server's
    TTFT; `rest` is what none of them covers (mostly the output's way back: poll, queue, SSE)."""
    def delta(key: str) -> dict | None:
        a, b = after.get(key), before.get(key)
        return None if not a or not b else {k: v - b.get(k, 0) for k, v in a.items()}
    eng, ctl = delta("first_token"), delta("controller_first_token")
    if not eng or not eng["first_tokens"]:
        return None
    n = eng["first_tokens"]
    out = {"queue": eng["queue_s"] / n * 1e3, "device": eng["device_s"] / n * 1e3,
           "report": eng["report_s"] / n * 1e3}
    if ctl and ctl["requests"]:
        m = ctl["requests"]
        out.update(http=ctl.get("http_s", 0.0) / m * 1e3, admit=ctl["admit_s"] / m * 1e3, ttft=ctl["ttft_s"] / m * 1e3)
        out["rest"] = out["ttft"] - out["http"] - out["admit"] - out["queue"] - out["device"] - out["report"]
    return {k: round(v, 2) for k, v in out.items()}


def with_replays(engine: dict, graph_stats: list[dict]) -> dict:
    """The engine's stats plus rank 0's replays of its decode graphs and its prefill graphs."""
    def replays(which: str) -> int | None:
        graphs = graph_stats[0].get(which) if graph_stats else None
        return None if graphs is None else graphs["replays"]
    return {**engine, "graph_replays": replays("graphs"), "prefill_replays": replays("prefill_graphs")}


def engine_stats(url: str, key: str | None) -> dict | None:
    try:
        with Client(url, key) as c:
            status = c.status()
            stats = with_replays(status["engine"], c.collective_rpc("graph_stats", ranks=[0]))
            return {**stats, "controller_first_token": status.get("first_token"), "at": time.monotonic(),
                    "loop_lag": status.get("loop_lag"), "process_cpu_s": status.get("process_cpu_s")}
    except Exception:  # noqa: BLE001 - an external server without an admin key: no step phases
        return None


def offline_stats(llm) -> dict:
    return with_replays(llm.executor.rank0_call("engine_stats", timeout=30.0), llm.collective_rpc("graph_stats"))


# ---- the same engine offline -----------------------------------------------------------------------

def offline_baseline(serve_argv: list[str], levels: list[tuple[int, int]], prompts: list[list[int]],
                     max_tokens: int) -> dict[int, dict]:
    """Output tokens/s of `service.LLM` built from the same serve options, generating the first
    `requests` prompts of each (clients, requests) level in waves of `clients`."""
    from service import LLM, SamplingParams
    from service.cli import build_parser
    from service.engine_config import engine_kwargs

    ns = build_parser().parse_args(["serve", *serve_argv])
    t0 = time.perf_counter()
    llm = LLM(distributed_executor_backend=ns.distributed_executor_backend, **engine_kwargs(ns))
    log(f"offline engine up in {time.perf_counter() - t0:.1f} s")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out = {}
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params)  # warm-up
        for clients, requests in levels:
            tokens, t0 = 0, time.perf_counter()
            before = offline_stats(llm)
            for i in range(0, requests, clients):
                wave = [{"prompt_token_ids": p} for p in prompts[i:min(i + clients, requests)]]
                tokens += sum(len(o.outputs[0].token_ids) for o in llm.generate(wave, params))
            wall = time.perf_counter() - t0
            out[clients] = {"requests": requests, "output_tokens": tokens, "wall_s": wall,
                            "tokens_per_s": tokens / wall,
                            "engine_steps": step_phases(before, offline_stats(llm))}
            log(f"offline, waves of {clients}: {out[clients]}")
    finally:
        llm.shutdown()
    return out


# ---- sleep/wake --------------------------------------------------------------------------------------

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


# ---- report ------------------------------------------------------------------------------------------

def print_report(loads: list[dict], overhead: dict, args) -> None:
    for load in loads:
        print(f"\nLoad: {load['clients']} clients, {load['requests']} requests x {args.max_tokens} tokens "
              f"(prompt {args.prompt_len}), {load['errors']} errors, {load['wall_s']:.1f} s")
        line = f"throughput: {load['tokens_per_s']:.1f} output tokens/s, {load['requests_per_s']:.2f} requests/s"
        if load.get("over_baseline") is not None:
            line += (f"; with {' '.join(load['baseline_args'])}: {load['baseline_tokens_per_s']:.1f} tokens/s -> "
                     f"{load['over_baseline']:.3f}x")
        if "offline_tokens_per_s" in load:
            line += (f"; offline (same engine, waves of {load['clients']}): {load['offline_tokens_per_s']:.1f} "
                     f"tokens/s -> HTTP / offline {load['http_over_offline']:.2f}")
        print(line + "\n")
        print("| metric | p50 | p90 | p99 |\n|---|---:|---:|---:|")
        for name, label in (("ttft", "time to first token (ms)"), ("itl", "inter-token latency (ms)"),
                            ("e2e", "request latency (ms)")):
            row = load[name]
            print(f"| {label} | {row['p50'] * 1e3:.1f} | {row['p90'] * 1e3:.1f} | {row['p99'] * 1e3:.1f} |")
        if load.get("first_error"):
            print(f"first error: {load['first_error']}")
    if overhead:
        print("\n| op (median of cycles) | HTTP round trip (ms) | slowest rank (ms) | controller overhead (ms) |")
        print("|---|---:|---:|---:|")
        for name, row in overhead.items():
            print(f"| {name} | {row['http_s'] * 1e3:.1f} | {row['ranks_s'] * 1e3:.1f} | "
                  f"{row['overhead_s'] * 1e3:.1f} |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url")
    p.add_argument("--admin-key", default=os.environ.get("LATENTSERVE_ADMIN_KEY"))
    p.add_argument("--device", default="cpu", help="cpu, or cuda: one GPU, TP 1 on the mp executor (no Ray)")
    p.add_argument("--model", help="default: tiny on the CPU, small on CUDA")
    p.add_argument("--tp", type=int, help="default: 2 on the CPU, 1 on CUDA")
    p.add_argument("--backend", choices=["ray", "mp"], help="executor (default: ray on the CPU, mp on CUDA)")
    p.add_argument("--layers", type=int, help="num_hidden_layers override (default: 24 on CUDA, as bench/gpu.py)")
    p.add_argument("--hf-overrides", help="more config overrides, JSON (e.g. '{\"vocab_size\": 32768}': the GPU "
                                          "presets' vocabulary, whose tokenizer costs more per request)")
    p.add_argument("--dtype", help="default: auto on the CPU, bfloat16 on CUDA")
    p.add_argument("--kv-cache-gib", type=float, default=4.0, help="CUDA: KV cache (256 x 256 tokens need 1.8 GB)")
    p.add_argument("--clients", help="concurrent streams, one load phase per comma-separated level "
                                     "(default: 8 on the CPU, 64,256 on CUDA)")
    p.add_argument("--client-procs", type=int, help="processes the clients are spread over (default 1; CUDA 8)")
    p.add_argument("--requests", type=int, help="requests per level (default: 64; CUDA: 4 per client)")
    p.add_argument("--duration", type=float, default=120.0, help="seconds per level at most")
    p.add_argument("--prompt-len", type=int)
    p.add_argument("--max-tokens", type=int)
    p.add_argument("--cycles", type=int, help="sleep/wake cycles (default: 5 on the CPU, 0 on CUDA)")
    p.add_argument("--offline", action=argparse.BooleanOptionalAction, default=None,
                   help="the same engine offline for the HTTP/offline ratio (default: on with CUDA)")
    p.add_argument("--json")
    p.add_argument("--server-log", help="the server's log file (default: a temporary file)")
    p.add_argument("--serve-args", help="extra `serve` options of the (first) server, e.g. '--async-output on'")
    p.add_argument("--py-spy", metavar="PATH", help="py-spy binary: sample the server's processes during the "
                   "largest level into <json's folder, or the temp folder>/pyspy_<clients>.txt and print where their time went")
    p.add_argument("--baseline-args", help="then the same levels on a second server with these extra `serve` "
                   "options (e.g. '--async-output off'), and the ratio of the two")
    args = p.parse_args(argv)
    cuda = args.device.startswith("cuda")
    for key, value in (CUDA_DEFAULTS if cuda else CPU_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.clients = [int(x) for x in str(args.clients).split(",") if x.strip()]
    except ValueError:
        p.error(f"--clients takes comma-separated integers, got {args.clients!r}")
    if not args.clients or min(args.clients) < 1:
        p.error("--clients needs at least one level, each >= 1")
    if args.requests is None:
        args.requests = 0 if cuda else 64  # 0: 4 per client, per level
    if args.offline is None:
        args.offline = cuda and not args.url
    if args.url:
        if urlparse(args.url).hostname not in ("127.0.0.1", "localhost", "::1"):
            p.error("loopback URLs only (this benchmark floods the server)")
        if args.offline or args.baseline_args:
            p.error("--offline and --baseline-args need the bench to start the server (they build the same engine)")
    if cuda and not args.url:
        import torch

        if not torch.cuda.is_available():
            p.error(f"--device {args.device} needs a CUDA GPU, and torch.cuda.is_available() is False on this "
                    "machine (run it on the GPU box: bench/gpu_serve.sh)")
    return args


def run_levels(args, argv_serve: list[str] | None, levels, prompts, env: dict | None = None) -> tuple[list[dict], dict]:
    """Start the server (unless --url; with `env` set), warm it, run each load level; (loads,
    sleep/wake overhead)."""
    server = None
    if args.url:
        url, key = args.url, args.admin_key
    else:
        log(f"starting {args.model} TP {args.tp} on {args.device}: {' '.join(argv_serve)}")
        server, seconds = start_healthy(argv_serve, log_path=args.server_log, env=env)
        log(f"ready in {seconds:.1f} s (log {server.log_path})")
        url, key = server.url, server.admin_key
    loads, overhead = [], {}
    try:
        warm = load_phase(url, 1, prompts[:2], 4, args.duration, 1)  # first requests: not measured
        log(f"warm-up: {warm['requests']} requests, {warm['errors']} errors")
        for clients, requests in levels:
            before = engine_stats(url, key)
            # Next to the JSON, or in the temp folder: never the working tree by default.
            spy_dir = os.path.dirname(os.path.abspath(args.json)) if args.json else tempfile.gettempdir()
            spy_path = os.path.join(spy_dir, f"pyspy_{clients}{'_baseline' if env is not None else ''}.txt")
            spy = (server_profile.Recording(args.py_spy, server.proc.pid, spy_path)
                   if args.py_spy and server is not None and clients == max(args.clients) else None)
            load = load_phase(url, clients, prompts[:requests], args.max_tokens, args.duration, args.client_procs)
            after = engine_stats(url, key)
            if spy is not None:
                log(f"py-spy of the server at {clients} clients ({spy_path}):\n{spy.stop()}")
            if before and after:
                load["engine_steps"] = step_phases(before, after)
            log(f"{clients} clients: {load['tokens_per_s']:.1f} output tokens/s, {load['requests']} requests, "
                f"{load['errors']} errors; TTFT p50/p99 {load['ttft']['p50'] * 1e3:.0f}/{load['ttft']['p99'] * 1e3:.0f} "
                f"(mean {load['ttft']['mean'] * 1e3:.0f}; first wave {load['ttft_first_wave'] * 1e3:.0f}, "
                f"after {load['ttft_after'] * 1e3:.0f}) "
                f"ms, ITL p50/p99 {load['itl']['p50'] * 1e3:.1f}/{load['itl']['p99'] * 1e3:.1f} ms; "
                f"client_cpu {load['client_cpu']} (busiest of {args.client_procs or 1}); engine steps "
                f"{load.get('engine_steps')}")
            loads.append(load)
        if key and args.cycles:
            with Client(url, key) as c:
                overhead = sleep_wake_overhead(c, args.cycles)
    finally:
        if server is not None:
            server.stop()
    return loads, overhead


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    levels = [(c, args.requests or 4 * c) for c in args.clients]
    prompts = make_prompts(max(n for _, n in levels), args.prompt_len)
    argv_serve = None if args.url else server_args(args) + shlex.split(args.serve_args or "")
    loads, overhead = run_levels(args, argv_serve, levels, prompts)
    if args.baseline_args:  # the same load on a second server with these options, in this run
        extra = shlex.split(args.baseline_args)
        env = dict(t.split("=", 1) for t in extra if re.match(r"[A-Z][A-Z0-9_]*=", t))  # LATENTSERVE_X=0 ...
        base_loads, _ = run_levels(argparse.Namespace(**{**vars(args), "cycles": 0}),
                                   argv_serve + [t for t in extra if t.split("=", 1)[0] not in env], levels, prompts, env)
        for load, base in zip(loads, base_loads):
            load["baseline_args"] = extra
            load["baseline_tokens_per_s"] = base["tokens_per_s"]
            load["over_baseline"] = load["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else None
            load["baseline_itl"], load["baseline_ttft"] = base["itl"], base["ttft"]
            load["baseline_engine_steps"], load["baseline_errors"] = base.get("engine_steps"), base["errors"]
            if load["over_baseline"] is not None:
                log(f"{load['clients']} clients: {load['tokens_per_s']:.1f} tokens/s against {base['tokens_per_s']:.1f} "
                    f"with {args.baseline_args!r}: {load['over_baseline']:.3f}x")
    if args.offline:
        done = [(load["clients"], load["requests"]) for load in loads if load["requests"]]
        offline = offline_baseline(argv_serve, done, prompts, args.max_tokens)
        for load in loads:
            base = offline.get(load["clients"])
            if base is not None:
                load["offline_tokens_per_s"] = base["tokens_per_s"]
                load["http_over_offline"] = load["tokens_per_s"] / base["tokens_per_s"]
                load["offline_engine_steps"] = base["engine_steps"]
    print_report(loads, overhead, args)
    summary = {"device": args.device, "model": args.model, "layers": args.layers, "tp": args.tp,
               "server_args": argv_serve, "loads": loads, "sleep_wake": overhead,
               "args": {k: v for k, v in vars(args).items() if k != "admin_key"}}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=2)
    brief = {"device": args.device, "levels": [{k: load.get(k) for k in (
        "clients", "requests", "errors", "tokens_per_s", "offline_tokens_per_s", "http_over_offline", "ttft", "itl",
        "baseline_tokens_per_s", "over_baseline")}
        for load in loads]}
    print("SUMMARY " + json.dumps(brief), flush=True)
    return 0 if not any(load["errors"] or load.get("baseline_errors") for load in loads) else 1


if __name__ == "__main__":
    sys.exit(main())
