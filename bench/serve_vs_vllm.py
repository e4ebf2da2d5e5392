"""A real client on both servers: `vllm bench serve` against `latentserve serve`, then against
`vllm serve`, on the same checkpoint, TP, request rate and prompts.

    .venv/bin/python bench/serve_vs_vllm.py [--checkpoint DIR] [--tp 1] [--num-prompts 64]
        [--request-rate 4,inf] [--input-len 64] [--output-len 64] [--max-concurrency N]
        [--servers ours,vllm] [--startup-timeout 600] [--bench-timeout 900] [--out results.json]

The client is vLLM's own serving benchmark (`.venv-vllm/bin/vllm bench serve --backend openai`,
`/v1/completions`, streaming with usage, random dataset, `ignore_eos`, greedy), run once per
server with the same seed, so both servers get the same prompts at the same (Poisson) arrival
times. The checkpoint is the anchor checkpoint of tests/anchors/checkpoint.py (DeepSeek-V3
with kv_lora_rank 512 / rope 64, fp32, with its word-level tokenizer), written to a temp dir
unless --checkpoint names one; it is both servers' model and the client's tokenizer.

Servers, one at a time (the box may have few cores), on loopback ports, started and stopped
here, each phase bounded in time (a server that is not healthy within --startup-timeout, or a
client run past --bench-timeout, ends the phase with an error):
- ours: `latentserve serve --model CKPT --tp N --dtype float32`; at TP > 1 it pins each rank to
  its own cores itself.
- vLLM: `vllm serve CKPT --tensor-parallel-size N --dtype float32 --attention-backend CPU_MLA`
  (as scripts/anchors does: CPU_MLA runs fp32 on every x86 CPU), VLLM_CPU_KVCACHE_SPACE=1;
  at TP > 1 `VLLM_CPU_OMP_THREADS_BIND` gives rank r the r-th block of allowed cores (one core
  per rank when TP equals the core count), as ours does; at TP 1 vLLM's own binding.
Both get the same --max-num-seqs and --max-model-len.

Prints output tokens/s, request throughput, TTFT, TPOT and ITL percentiles per server and
ours / vLLM (throughput: higher is better for ours; latencies: lower is better for ours).
ITL is vLLM's definition: the gap between consecutive reads of streamed chunks that carry
choices; SSE messages that arrive in one socket read get the same timestamp (gaps of 0), so
ITL percentiles depend on how a server flushes its stream. TPOT ((latency - TTFT) / (tokens -
1) per request) does not, and is the per-token number to compare.

Our server has no /tokenize: the client's prompt alignment step then prints "/tokenize
unavailable, skipping alignment" and keeps its prompts as they are. Both servers load the
client's tokenizer (the checkpoint's), so the prompts are the same either way (vLLM's
/tokenize agrees with the client's token counts and it realigns nothing either).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from throughput import allowed_cpus, git_commit, loadavg  # noqa: E402  (bench/: the script's folder)

from service.server.launch import LocalServer, ServerProcess  # noqa: E402

VLLM_BIN = os.path.join(ROOT, ".venv-vllm", "bin")
# vllm-cpu's `vllm` console script asks importlib.metadata for the version of "vllm", a
# distribution that vllm-cpu does not install (it is "vllm-cpu"), and dies before parsing its
# arguments. So the CLI runs from this shim: the same entry point, with that lookup answered as
# vllm/platforms does it ("vllm-cpu"'s version + "+cpu", which is also how it detects CPU).
VLLM_CLI_SHIM = (
    "import importlib.metadata as md, sys\n"
    "_version = md.version\n"
    "md.version = lambda name: _version('vllm-cpu') + '+cpu' if name == 'vllm' else _version(name)\n"
    "from vllm.entrypoints.cli.main import main\n"
    "sys.argv[0] = 'vllm'\n"
    "sys.exit(main())\n"
)


def vllm_cli(*args: str) -> list[str]:
    """The command line of `vllm ARGS` in .venv-vllm."""
    return [os.path.join(VLLM_BIN, "python"), "-c", VLLM_CLI_SHIM, *args]
PCTS = (50, 90, 99)
METRICS = ("ttft", "tpot", "itl", "e2el")


def log(msg: str) -> None:
    print(f"[serve-vs-vllm {time.strftime('%H:%M:%S')}] {msg}", flush=True)


class VllmServer(ServerProcess):
    """`vllm serve` from .venv-vllm in its own session (killed with its engine and workers)."""

    name = "vllm serve"

    def __init__(self, ckpt: str, tp: int, max_num_seqs: int, max_model_len: int, log_path: str,
                 extra: list[str]):
        super().__init__()
        cmd = [*vllm_cli("serve", ckpt), "--tensor-parallel-size", str(tp),
               "--dtype", "float32", "--attention-backend", "CPU_MLA", "--seed", "0",
               "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len),
               "--host", "127.0.0.1", "--port", str(self.port), *extra]
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("TOKENIZERS_PARALLELISM", "false")
        if tp > 1:
            cpus = allowed_cpus()
            share = max(1, len(cpus) // tp)
            env.setdefault("VLLM_CPU_OMP_THREADS_BIND", "|".join(
                ",".join(str(cpus[(r * share + i) % len(cpus)]) for i in range(share)) for r in range(tp)))
        self.bind = env.get("VLLM_CPU_OMP_THREADS_BIND", "auto")
        # Its own cwd: vLLM must not import this repo's packages by accident.
        self._spawn(cmd, tempfile.gettempdir(), env, log_path)


def run_client(url: str, ckpt: str, args, rate: str, result_dir: str, name: str) -> dict:
    """`vllm bench serve` against `url` at `rate` requests/s; its saved result JSON."""
    filename = f"{name}.json"
    cmd = [*vllm_cli("bench", "serve"), "--backend", "openai", "--base-url", url,
           "--endpoint", "/v1/completions", "--model", ckpt, "--tokenizer", ckpt,
           "--dataset-name", "random", "--random-input-len", str(args.input_len),
           "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
           "--request-rate", rate, "--seed", str(args.seed), "--temperature", "0",
           "--ignore-eos", "--percentile-metrics", ",".join(METRICS),
           "--metric-percentiles", ",".join(map(str, PCTS)), "--disable-tqdm",
           "--save-result", "--save-detailed", "--result-dir", result_dir, "--result-filename", filename]
    if args.max_concurrency:
        cmd += ["--max-concurrency", str(args.max_concurrency)]
    if args.num_warmups:
        cmd += ["--num-warmups", str(args.num_warmups)]
    log(f"client: vllm {shlex.join(cmd[3:])}")
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false")
    env.pop("OPENAI_API_KEY", None)
    proc = subprocess.run(cmd, cwd=result_dir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=args.bench_timeout, env=env)
    with open(os.path.join(result_dir, f"{name}-client.log"), "w") as f:
        f.write(proc.stdout)
    # Its warnings (e.g. "/tokenize unavailable") and its report, without the teardown noise.
    lines = proc.stdout.splitlines()
    print("\n".join(ln for ln in lines if ln.startswith("WARNING") or "Error" in ln), flush=True)
    start = next((i for i, ln in enumerate(lines) if "Serving Benchmark Result" in ln), max(0, len(lines) - 40))
    print("\n".join(ln for ln in lines[start:] if not ln.startswith((" - ", "nanobind", "See https"))), flush=True)
    path = os.path.join(result_dir, filename)
    if proc.returncode != 0 or not os.path.exists(path):
        raise RuntimeError(f"vllm bench serve exited {proc.returncode}:\n{proc.stdout[-4000:]}")
    with open(path) as f:
        return json.load(f)


def summarize(result: dict, expected_tokens: int) -> dict:
    s = {"completed": result.get("completed"), "failed": result.get("failed", 0),
         "duration_s": result.get("duration"), "output_tokens": result.get("total_output_tokens"),
         "expected_output_tokens": expected_tokens, "output_tokens_per_s": result.get("output_throughput"),
         "requests_per_s": result.get("request_throughput"),
         "max_concurrent_requests": result.get("max_concurrent_requests")}
    for m in METRICS:
        s[m] = {"mean": result.get(f"mean_{m}_ms"),
                **{f"p{p}": result.get(f"p{p}_{m}_ms") for p in PCTS}}
    errors = [e for e in result.get("errors", []) if e]
    if errors:
        s["first_error"] = errors[0][-2000:]
    return s


def serve_phase(name: str, ckpt: str, args, result_dir: str) -> dict:
    """One server, started and stopped here; the client once per request rate. {rate: summary}."""
    log_path = os.path.join(result_dir, f"{name}-server.log")
    if name == "ours":
        serve_args = ["--model", ckpt, "--tp", str(args.tp), "--dtype", "float32", "--seed", "0",
                      "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", str(args.max_model_len)]
        server = LocalServer(serve_args, admin_key=None, log_path=log_path)
        how = f"latentserve serve {shlex.join(serve_args)}"
    else:
        server = VllmServer(ckpt, args.tp, args.max_num_seqs, args.max_model_len, log_path, args.vllm_args)
        how = f"VLLM_CPU_OMP_THREADS_BIND={server.bind} vllm {shlex.join(server.cmd[3:])}"
    log(f"{name}: starting {how} (log {log_path}, load {loadavg()})")
    out = {}
    try:
        startup = server.wait_ready(args.startup_timeout)
        log(f"{name}: healthy after {startup:.1f} s; load {loadavg()}")
        for rate in args.request_rate:
            load_before = loadavg()
            t0 = time.perf_counter()
            result = run_client(server.url, ckpt, args, rate, result_dir, f"{name}-rate{rate}")
            s = summarize(result, args.num_prompts * args.output_len)
            s.update(startup_s=startup, client_wall_s=time.perf_counter() - t0, load_before=load_before,
                     load_after=loadavg(), command=how)
            log(f"{name}, rate {rate}: {s['completed']} requests, {s['output_tokens']} output tokens, "
                f"{s['output_tokens_per_s']:.1f} tok/s; load {load_before} -> {s['load_after']}")
            out[rate] = s
    except Exception as e:
        log(f"{name}: failed: {type(e).__name__}: {str(e)[-3000:]}\nserver log tail:\n{server.log(3000)}")
        raise
    finally:
        server.stop()
    return out


def ratio(a, b) -> float:
    return a / b if a is not None and b else float("nan")


def print_table(res: dict, rate: str, args) -> None:
    names = [n for n in ("ours", "vllm") if rate in res.get(n, {})]
    if not names:
        return
    print(f"\nvllm bench serve: TP {args.tp}, {args.num_prompts} prompts, random {args.input_len} in / "
          f"{args.output_len} out, request rate {rate}/s"
          + (f", max concurrency {args.max_concurrency}" if args.max_concurrency else "") + ", greedy, fp32")
    head = "| metric | " + " | ".join(names) + (" | ours / vLLM |" if len(names) == 2 else " |")
    print(head + "\n|---|" + "---:|" * (len(names) + (len(names) == 2)))

    def row(label, get):
        vals = [get(res[n][rate]) for n in names]
        cells = " | ".join("-" if v is None else f"{v:.1f}" for v in vals)
        extra = f" | {ratio(vals[0], vals[1]):.2f}" if len(names) == 2 else ""
        print(f"| {label} | {cells}{extra} |")

    row("output tokens/s", lambda s: s["output_tokens_per_s"])
    row("requests/s", lambda s: s["requests_per_s"])
    for m, label in (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2el", "E2E latency")):
        for p in ("mean", *(f"p{q}" for q in PCTS)):
            row(f"{label} {p} (ms)", lambda s, m=m, p=p: s[m][p])
    for n in names:
        s = res[n][rate]
        print(f"{n}: completed {s['completed']}, failed {s['failed']}, output tokens {s['output_tokens']} "
              f"(expected {s['expected_output_tokens']}), peak concurrency {s['max_concurrent_requests']}, "
              f"startup {s['startup_s']:.1f} s, load {s['load_before']} -> {s['load_after']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="checkpoint dir (default: the anchor checkpoint in a temp dir)")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--request-rate", default="4,inf",
                    help="requests/s (Poisson) or inf, comma-separated: one client run per rate per server start")
    ap.add_argument("--max-concurrency", type=int, default=0)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-warmups", type=int, default=2)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=512)
    ap.add_argument("--servers", default="ours,vllm")
    ap.add_argument("--vllm-args", default="", help="extra `vllm serve` arguments (one string)")
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--bench-timeout", type=float, default=900)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--keep", help="keep the client results and server logs in this dir")
    args = ap.parse_args()
    args.vllm_args = shlex.split(args.vllm_args)
    args.request_rate = args.request_rate.split(",")
    if not os.path.exists(os.path.join(VLLM_BIN, "python")):
        ap.error("no .venv-vllm: run `bash scripts/anchors/setup-vllm.sh`")

    tmp = tempfile.TemporaryDirectory(prefix="serve-vs-vllm-")
    work = args.keep or tmp.name
    os.makedirs(work, exist_ok=True)
    ckpt = args.checkpoint
    if ckpt is None:
        from tests.anchors.checkpoint import write_hf_checkpoint

        ckpt = write_hf_checkpoint(os.path.join(tmp.name, "ckpt"), seed=0, zero_rope=False)
        log(f"wrote the anchor checkpoint to {ckpt}")
    ckpt = os.path.abspath(ckpt)
    commit = git_commit()
    log(f"commit {commit}, load average {loadavg()}, {len(allowed_cpus())} allowed cores")
    res: dict = {}
    failures = {}
    for name in args.servers.split(","):
        try:
            res[name] = serve_phase(name, ckpt, args, work)
        except Exception as e:  # the other server still runs; the exit status says it failed
            failures[name] = f"{type(e).__name__}: {str(e)[-2000:]}"
    print(f"\ncommit {commit}")
    for rate in args.request_rate:
        print_table(res, rate, args)
    for name, err in failures.items():
        print(f"{name}: FAILED: {err}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "commit": commit, "results": res, "failures": failures}, f, indent=2)
    tmp.cleanup()
    bad = failures or any(s["failed"] or s["output_tokens"] != s["expected_output_tokens"]
                          for per_rate in res.values() for s in per_rate.values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
