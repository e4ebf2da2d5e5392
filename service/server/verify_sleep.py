"""`latentserve verify-sleep`: the seed's test plan (DESIGN §4), through the HTTP API.

Against a server it starts (4 layers, sleep mode on, every parameter preserved, test hooks on)
or one given by --url:
  1. every MoE layer's tail is fused on every rank (collective_rpc tail_state);
  2. greedy generation of P prompts x T tokens before sleep (twice), after sleep(1)+wake, and
     after each of two sleep(2)+wake(weights)+wake(kv_cache) cycles, each compared token for
     token with the first; the fused path must have been taken on every rank;
  3. negative control on fresh ranks (POST /restart): the tail's Lamport flags are zeroed after
     the first level-2 wake; the next generation must fail with a clear error, in time, and
     the ranks must then re-arm in place: the generation after it (no restart) gives the
     tokens of before the sleep.
Prints the seed's result table with our numbers; exits 0 only if every column is P/P and the
control failed in time.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass, field

from ..client import Client, ServiceError
from .launch import start_healthy

SEED_TABLE = "| Run | Tail fusion on (runners per rank) | Repeat | After L1 | After L2 #1 | After L2 #2 |"


@dataclass
class Outcome:
    label: str
    fusion: str = "?"
    columns: list[str] = field(default_factory=list)
    ok: bool = False
    timings: list[tuple[str, float]] = field(default_factory=list)


def make_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Short token-id prompts (ids 5..255: no special tokens, inside any vocabulary we serve)."""
    rng = random.Random(seed)
    return [[rng.randrange(5, 256) for _ in range(rng.randrange(4, 9))] for _ in range(n)]


class Plan:
    def __init__(self, client: Client, prompts: list[list[int]], tokens: int, tail_deadline_s: float):
        self.c = client
        self.prompts = prompts
        self.tokens = tokens
        self.tail_deadline_s = tail_deadline_s

    def _timed(self, out: Outcome, label: str, fn, *args, **kw):
        t0 = time.perf_counter()
        result = fn(*args, **kw)
        out.timings.append((label, time.perf_counter() - t0))
        return result

    def generate(self, out: Outcome, label: str) -> list[list[int]]:
        r = self._timed(out, f"generate {label}", self.c.completions, self.prompts, max_tokens=self.tokens,
                        temperature=0.0, ignore_eos=True)
        return [ch["token_ids"] for ch in sorted(r["choices"], key=lambda ch: ch["index"])]

    def same(self, a: list[list[int]], b: list[list[int]]) -> str:
        return f"{sum(x == y for x, y in zip(a, b))}/{len(self.prompts)}"

    def fusion(self) -> tuple[bool, str, list[list[dict]]]:
        states = self.c.collective_rpc("tail_state")
        fused = [sum(layer["fused"] for layer in rank) for rank in states]
        total = len(states[0])
        all_on = total > 0 and all(f == total for f in fused)
        text = f"{min(fused)} / {total} on all {len(states)} ranks" if all_on else f"fused per rank: {fused}/{total}"
        return all_on, text, states

    @staticmethod
    def path_taken(before: list[list[dict]], after: list[list[dict]]) -> bool:
        return all(a["fused_calls"] > b["fused_calls"] for rb, ra in zip(before, after) for b, a in zip(rb, ra))

    def sleep_wake(self, out: Outcome, level: int, label: str) -> None:
        self._timed(out, f"sleep({level}) {label}", self.c.sleep, level)
        if level == 1:
            self._timed(out, f"wake_up() {label}", self.c.wake_up)
            return
        self._timed(out, f"wake_up(weights) {label}", self.c.wake_up, ["weights"])
        self._timed(out, f"wake_up(kv_cache) {label}", self.c.wake_up, ["kv_cache"])

    def main_run(self, label: str) -> Outcome:
        out = Outcome(label)
        on, out.fusion, before = self.fusion()
        first = self.generate(out, "before sleep")
        _, _, after = self.fusion()
        taken = self.path_taken(before, after)
        out.fusion += ", fused path taken" if taken else ", FUSED PATH NOT TAKEN"
        out.columns.append(self.same(first, self.generate(out, "repeat")))
        self.sleep_wake(out, 1, "L1")
        out.columns.append(self.same(first, self.generate(out, "after L1")))
        for i in (1, 2):
            self.sleep_wake(out, 2, f"L2 #{i}")
            out.columns.append(self.same(first, self.generate(out, f"after L2 #{i}")))
        still_on, _, _ = self.fusion()
        full = f"{len(self.prompts)}/{len(self.prompts)}"
        out.ok = on and taken and still_on and all(c == full for c in out.columns)
        return out

    def control_run(self) -> Outcome:
        out = Outcome("Negative control (flags zeroed after L2 #1)")
        self._timed(out, "restart (fresh ranks)", self.c.restart)
        on, out.fusion, _ = self.fusion()
        first = self.generate(out, "before sleep")
        self._timed(out, "sleep(2)", self.c.sleep, 2)
        self._timed(out, "wake_up(weights)", self.c.wake_up, ["weights"])
        self.c.collective_rpc("zero_tail_flags")
        self._timed(out, "wake_up(kv_cache)", self.c.wake_up, ["kv_cache"])
        bound = 3 * self.tail_deadline_s + 30.0
        t0 = time.perf_counter()
        try:
            self._control_generate(bound)
            seconds = time.perf_counter() - t0
            out.columns.append(f"NO ERROR after {seconds:.1f} s: lost tail state went unnoticed")
        except ServiceError as e:
            seconds = time.perf_counter() - t0
            timely = seconds <= bound
            out.ok = on and timely
            kind = "clear, timely error" if timely else f"error too late (bound {bound:.0f} s)"
            out.columns.append(f"{kind} after {seconds:.1f} s: HTTP {e.status}: {e.message[:300]}")
        except Exception as e:  # the client gave up: the request hung
            seconds = time.perf_counter() - t0
            out.columns.append(f"HANG: no answer within {seconds:.0f} s ({type(e).__name__})")
        out.timings.append(("generate (control)", seconds))
        if out.ok:
            out.ok = self._served_again(out, first)
        return out

    def _served_again(self, out: Outcome, first: list[list[int]]) -> bool:
        """After the failed request the ranks re-arm in place: the same tokens, no restart."""
        try:
            same = self.same(first, self.generate(out, "after the error (no restart)"))
        except ServiceError as e:
            out.columns[-1] += f"; NOT SERVED AGAIN without restart: HTTP {e.status}: {e.message[:200]}"
            return False
        out.columns[-1] += f"; then served again without restart: {same}"
        return same == f"{len(self.prompts)}/{len(self.prompts)}"

    def _control_generate(self, bound: float) -> None:
        with Client(self.c.base_url, self.c.admin_key, timeout=bound + 30.0) as c:
            c.completions(self.prompts, max_tokens=self.tokens, temperature=0.0, ignore_eos=True)


def _serve_args(args: argparse.Namespace) -> list[str]:
    overrides = args.hf_overrides if args.hf_overrides is not None else {"num_hidden_layers": 4}
    argv = ["--model", args.model, "--tp", str(args.tp), "--dtype", args.dtype, "--device", args.device,
            "--seed", str(args.seed), "--hf-overrides", json.dumps(overrides), "--fused-tail", args.fused_tail,
            "--tail-deadline-s", str(args.tail_deadline_s), "--max-num-seqs", str(max(args.max_num_seqs, args.prompts)),
            "--enable-sleep-mode", "--sleep-preserve-parameter-names", "*", "--enable-test-hooks"]
    if args.ray_address:
        argv += ["--ray-address", args.ray_address]
    if args.max_model_len:
        argv += ["--max-model-len", str(args.max_model_len)]
    return argv


def print_report(runs: list[Outcome], where: str, startup: float | None) -> None:
    print(f"\nlatentserve verify-sleep: {where}\n")
    print(SEED_TABLE)
    print("|---|---|---|---|---|---|")
    for r in runs:
        cells = r.columns + [""] * (4 - len(r.columns)) if len(r.columns) > 1 else r.columns
        print("| " + " | ".join([r.label, r.fusion, *cells]) + " |")
    print("\nTimings (HTTP round trips, seconds)")
    if startup is not None:
        print(f"  server startup (ranks loaded, healthy): {startup:.1f}")
    for r in runs:
        for label, seconds in r.timings:
            print(f"  {r.label[:24]:<24} {label:<28} {seconds:8.3f}")


def main(args: argparse.Namespace) -> int:
    prompts = make_prompts(args.prompts)
    server, startup = None, None
    url, key = args.url, args.admin_key
    if url is None:
        print(f"starting latentserve serve (TP {args.tp}) ...", flush=True)
        server, startup = start_healthy(_serve_args(args))
        print(f"  healthy after {startup:.1f} s (log: {server.log_path})", flush=True)
        url, key = server.url, server.admin_key
    elif not key:
        print("verify-sleep: --url needs --admin-key (or LATENTSERVE_ADMIN_KEY)")
        return 2
    runs: list[Outcome] = []
    try:
        with Client(url, key, timeout=600.0) as c:
            c.wait_ready(timeout=600.0)
            plan = Plan(c, prompts, args.tokens, args.tail_deadline_s)
            runs.append(plan.main_run(f"latentserve (TP {args.tp}, {args.device})"))
            print_progress(runs[-1])
            runs.append(plan.control_run())
            print_progress(runs[-1])
            if server is None and not runs[-1].ok:
                c.restart()  # leave the given service healthy
    except Exception as e:
        print(f"verify-sleep: aborted: {type(e).__name__}: {e}")
        if server is not None:
            print(server.log())
        return 1
    finally:
        if server is not None:
            server.stop()
    print_report(runs, f"{url}, {len(prompts)} prompts x {args.tokens} tokens, greedy", startup)
    ok = all(r.ok for r in runs)
    print("\nRESULT:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


def print_progress(run: Outcome) -> None:
    print(f"  {run.label}: {run.fusion}; {' | '.join(run.columns)}", flush=True)
