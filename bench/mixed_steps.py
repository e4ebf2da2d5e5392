"""Mixed steps (decodes beside prompts) of a fresh engine against the same steps once warm.

    python3 bench/mixed_steps.py [--device cuda] [--waves 2] [--wave 256] [--json out.json]

The engine runs in process (`uni` executor) with bench/serve.py's CUDA options (`small`, 24
layers, bf16, graphs up to the wave size, 8192-token steps). Each wave generates --wave prompts
of --prompt-len tokens for --max-tokens tokens, so its steps are the same in every wave: a
prefill step, mixed steps while prompts still arrive, then decodes. Every `execute` is timed
with a device sync, and its host part apart: the time until `execute` returns (the launch) and
the host syncs inside it (torch's sync debug mode). Run 69: a served mixed step held the host
34 ms at 256 streams, a graphed decode step 0.3 ms; whether that is launching or waiting is what
`host_ms`, `syncs` and the first sync say (`mixed_first_sync`: host ms until it, and its line;
run 75: one sync a step, host 0.83 of the step). Wave 1 against the last wave is what first
uses inside served steps cost (plans, compiles, lazy kernel loads); the startup warm-up exists to
make it 1.0. Triton compiles during each wave are counted, where Triton is installed.
On a CPU it runs `tiny` at TP 1 (a check of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from serve import make_prompts  # noqa: E402

from service import LLM, SamplingParams  # noqa: E402
from service.cli import build_parser  # noqa: E402
from service.cluster.worker import RankWorker  # noqa: E402
from service.engine_config import engine_kwargs  # noqa: E402


def log(msg: str) -> None:
    print(f"[mixed-steps {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class StepClock:
    """Wraps RankWorker.execute: (decodes, prompt chunks, tokens, ms, host ms, host syncs) of
    every step."""

    def __init__(self, cuda: bool):
        self.cuda, self.steps, self.compiles = cuda, [], 0
        self._execute = RankWorker.execute
        clock = self

        def execute(worker, plan, **kw):  # kw: defer_checks (async output)
            if clock.cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            syncs = []  # (ms since t0, where): the warning comes before the sync waits

            def seen(message, *a, **k):
                if "synchroniz" in str(message):
                    syncs.append(((time.perf_counter() - t0) * 1e3, sync_site()))
            with warnings.catch_warnings():
                warnings.simplefilter("always")
                warnings.showwarning = seen
                if clock.cuda:
                    torch.cuda.set_sync_debug_mode("warn")
                try:
                    out = clock._execute(worker, plan, **kw)
                finally:
                    if clock.cuda:
                        torch.cuda.set_sync_debug_mode("default")
            host = time.perf_counter() - t0
            if clock.cuda:
                torch.cuda.synchronize()
            decodes = sum(1 for c in plan.chunks if len(c.token_ids) == 1 and c.start_pos > 0)
            clock.steps.append((decodes, len(plan.chunks) - decodes, sum(len(c.token_ids) for c in plan.chunks),
                                (time.perf_counter() - t0) * 1e3, host * 1e3, len(syncs), syncs[:1]))
            return out

        RankWorker.execute = execute
        self._count_compiles()

    def _count_compiles(self) -> None:
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:
            return
        compile_ = JITFunction._do_compile
        clock = self

        def counted(fn, *args, **kwargs):
            clock.compiles += 1
            return compile_(fn, *args, **kwargs)

        JITFunction._do_compile = counted


def sync_site() -> str:
    """The innermost latentserve frame below this warning: where a step waits for the device."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        if f"{os.sep}service{os.sep}" in frame.filename:
            return f"{os.path.relpath(frame.filename, ROOT)}:{frame.lineno} {frame.name}"
    return "?"


def summary(steps: list[tuple]) -> dict:
    mixed = [s for s in steps if s[0] and s[1]]
    prefill = [s[3] for s in steps if s[1] and not s[0]]
    return {"steps": len(steps), "mixed_ms": [round(s[3], 1) for s in mixed], "mixed_total_ms": sum(s[3] for s in mixed),
            "mixed_host_ms": [round(s[4], 1) for s in mixed], "mixed_host_syncs": [s[5] for s in mixed],
            # host ms until the first sync, and where it is: the launching before the step waits
            "mixed_first_sync": [(round(s[6][0][0], 1), s[6][0][1]) if s[6] else None for s in mixed],
            "prefill_ms": [round(x, 1) for x in prefill], "step_ms_total": sum(s[3] for s in steps)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--waves", type=int, default=2)
    ap.add_argument("--wave", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=6)
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.waves < 2:
        ap.error("--waves must be >= 2: the last wave is the warm baseline")
    cuda = args.device.startswith("cuda")
    if cuda:
        sizes = ",".join(str(1 << i) for i in range(args.wave.bit_length()) if 1 << i < args.wave) + f",{args.wave}"
        argv = ["--model", "small", "--dtype", "bfloat16", "--hf-overrides", '{"num_hidden_layers": 24}',
                "--dummy-weights", "device", "--cuda-graph-batch-sizes", sizes, "--kv-cache-memory-gib", "4.0",
                "--max-num-batched-tokens", "8192"]
    else:
        argv = ["--model", "tiny", "--max-num-batched-tokens", str(max(64, args.wave * args.prompt_len // 4))]
    argv += ["--tp", "1", "--device", args.device, "--max-num-seqs", str(args.wave),
             "--max-model-len", str(max(256, args.prompt_len + args.max_tokens))]
    clock = StepClock(cuda)
    t0 = time.perf_counter()
    llm = LLM(distributed_executor_backend="uni", **engine_kwargs(build_parser().parse_args(["serve", *argv])))
    log(f"engine up in {time.perf_counter() - t0:.1f} s ({clock.compiles} Triton compiles)")
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    prompts = make_prompts(args.wave * args.waves, args.prompt_len)
    waves = []
    try:
        llm.generate([{"prompt_token_ids": p} for p in prompts[:2]], params)
        for w in range(args.waves):
            clock.steps, clock.compiles = [], 0
            batch = prompts[w * args.wave:(w + 1) * args.wave]
            llm.generate([{"prompt_token_ids": p} for p in batch], params)
            waves.append({**summary(clock.steps), "triton_compiles": clock.compiles})
            log(f"wave {w + 1}: {waves[-1]}")
    finally:
        llm.shutdown()
    first, warm = waves[0], waves[-1]
    if not warm["steps"]:  # each request failed (its error is in the log above)
        log("no step ran")
        return 1
    ratio = first["mixed_total_ms"] / warm["mixed_total_ms"] if warm["mixed_total_ms"] else float("nan")
    print(f"mixed steps, first wave / warm wave: {first['mixed_total_ms']:.1f} / {warm['mixed_total_ms']:.1f} ms "
          f"= {ratio:.2f}x ({len(first['mixed_ms'])} steps; {first['triton_compiles']} Triton compiles in the "
          f"first wave, {warm['triton_compiles']} in the last)", flush=True)
    host, total = sum(warm["mixed_host_ms"]), warm["mixed_total_ms"]
    print(f"warm mixed steps: host (until execute returns) / whole step {host:.1f} / {total:.1f} ms = "
          f"{host / total if total else float('nan'):.2f}; host syncs a step {warm['mixed_host_syncs']}; first sync "
          f"(host ms, where) {warm['mixed_first_sync']}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "argv": argv, "waves": waves, "first_over_warm": ratio}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
