"""Where a decode step's time goes, per part, on every rank (wall time, not CPU samples).

    .venv/bin/python bench/step_profile.py [--tp 1] [--batch 16] [--tokens 32] [--threads N]
        [--checkpoint DIR | --preset small --layers 24 --device cuda] [--rounds 3] [--out result.json]

Wraps the engine's and the model's functions (scheduler, plan broadcast, metadata, attention,
MoE, collectives, lm_head, sampler, detokenizer, ...) with timers, on rank 0 in this process
and on the other ranks through a sitecustomize in their spawned processes
(`distributed_executor_backend="mp"`; rank 0 runs in a process of its own as well). Each part's
inclusive and exclusive (minus timed children) time per step is printed, per rank, for the
best of --rounds timed generate calls of --batch prompts x --tokens new tokens (same prompts as
bench/throughput.py, the anchor checkpoint by default). Time outside every timed part is
reported as "other" (Python glue, thread hand-offs).

With --preset (dummy weights on the device, bf16 on CUDA) the same runs on a GPU, where a decode
step is one CUDA graph replay: the parts then say how much of a step is host time that the
device waits through. The sampler's exclusive time includes the wait for the step's logits.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import os
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (module, qualified name) of each timed callable; a name missing in the tree is skipped.
TARGETS = [
    ("service.engine.llm_engine", "LLMEngine.step"),
    ("service.engine.scheduler", "Scheduler.schedule"),
    ("service.engine.scheduler", "Scheduler.postprocess"),
    ("service.engine.llm_engine", "LLMEngine._land"),
    ("service.engine.llm_engine", "LLMEngine._report"),
    ("service.engine.llm_engine", "LLMEngine._output"),
    ("service.engine.sampler", "Sampler.__call__"),
    ("service.engine.plan", "PlanCodec.encode"),
    ("service.engine.plan", "PlanCodec.decode"),
    ("service.cluster.worker", "RankWorker.execute"),
    ("service.model.cuda_graph", "DecodeGraphs.run"),
    ("service.model.cuda_graph", "pack_decode"),
    ("torch.cuda", "CUDAGraph.replay"),
    ("service.engine.llm_engine", "LLMEngine._admit"),
    ("service.cluster.engine_loop", "EngineLoop._publish"),
    ("service.tokenizer", "IncrementalDetokenizer.add"),
    ("service.cluster.worker", "RankWorker.check_runnable"),
    ("service.parallel", "TPGroup.broadcast_ints"),
    ("service.parallel", "TPGroup.all_reduce"),
    ("service.parallel", "TPGroup.all_gather"),
    ("service.model.attention", "AttnMetadata.build"),
    ("service.model.model", "DecoderModel.forward"),
    ("service.model.layers", "VocabParallelEmbedding.forward"),
    ("service.model.layers", "RMSNorm.forward"),
    ("service.model.attention", "MLAAttention.forward"),
    ("service.model.attention", "MLAAttention._absorbed_decode"),
    ("service.model.moe", "MoE.forward"),
    ("service.model.moe", "TopkRouter.forward"),
    ("service.model.moe", "FusedExperts.forward"),
    ("service.model.layers", "GatedMLP.forward"),
    ("service.model.layers", "ParallelLMHead.forward"),
    ("service.tail.base", "TailRunner.__call__"),
]

# --clock thread: CPU time of the calling thread (what other load on the box does not inflate,
# except through shared caches); default wall time.
_clock = time.thread_time if os.environ.get("LATENTSERVE_STEP_PROFILE_CLOCK") == "thread" else time.perf_counter
_stats: dict[str, list[float]] = {}  # name -> [calls, inclusive s, exclusive s]
_local = threading.local()


def _wrap(name: str, fn):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        stack = getattr(_local, "stack", None)
        if stack is None:
            stack = _local.stack = []
        stack.append(0.0)  # time of timed children
        t0 = _clock()
        try:
            return fn(*args, **kwargs)
        finally:
            dt = _clock() - t0
            child = stack.pop()
            if stack:
                stack[-1] += dt
            s = _stats.setdefault(name, [0, 0.0, 0.0])
            s[0] += 1
            s[1] += dt
            s[2] += dt - child
    timed.__wrapped_by_step_profile__ = True
    return timed


def install() -> list[str]:
    done = []
    for module, qual in TARGETS:
        try:
            mod = importlib.import_module(module)
        except ImportError:
            continue
        owner, attr = (mod, qual) if "." not in qual else (getattr(mod, qual.split(".")[0], None), qual.split(".")[1])
        fn = getattr(owner, attr, None) if owner is not None else None
        if fn is None or getattr(fn, "__wrapped_by_step_profile__", False):
            continue
        if isinstance(owner, type) and isinstance(owner.__dict__.get(attr), staticmethod):
            continue
        setattr(owner, attr, _wrap(qual, fn))
        done.append(qual)
    return done


def reset() -> None:
    _stats.clear()


def snapshot() -> dict:
    return {k: list(v) for k, v in _stats.items()}


# ---- rank processes: installed through sitecustomize, dumped on request ----------------------
def _child_hooks() -> None:
    """In a rank process: time everything, and let the driver reset / read the stats."""
    install()
    from service.cluster import worker, worker_rpc

    def rpc_step_profile(self, action: str = "read"):
        if action == "reset":
            reset()
            return {}
        return {"rank": self.rank, "stats": snapshot()}

    worker.RankWorker.rpc_step_profile = rpc_step_profile
    worker_rpc.DIAGNOSTICS = (*worker_rpc.DIAGNOSTICS, "step_profile")


SITECUSTOMIZE = f"""
import os, sys
if os.environ.get("LATENTSERVE_STEP_PROFILE"):
    sys.path.insert(0, {os.path.join(ROOT, 'bench')!r})
    sys.path.insert(0, {ROOT!r})
    import step_profile
    step_profile._child_hooks()
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint")
    ap.add_argument("--preset", help="a model preset with dummy weights instead of the anchor checkpoint")
    ap.add_argument("--layers", type=int, help="--preset's num_hidden_layers")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall",
                    help="time parts by wall clock or by the calling thread's CPU time")
    ap.add_argument("--out")
    args = ap.parse_args()
    os.environ["LATENTSERVE_STEP_PROFILE_CLOCK"] = args.clock

    site = tempfile.mkdtemp(prefix="step-profile-site-")
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(SITECUSTOMIZE)
    os.environ["PYTHONPATH"] = os.pathsep.join([site, ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    os.environ["LATENTSERVE_STEP_PROFILE"] = "1"
    if args.threads:
        os.environ["LATENTSERVE_THREADS_PER_RANK"] = str(args.threads)
    sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts", "anchors")]
    from decode_bench import bench_prompts

    from service import LLM, SamplingParams

    tmp = None
    if args.preset:
        from service.config import PRESETS

        overrides = {"num_hidden_layers": args.layers} if args.layers else {}
        vocab = PRESETS[args.preset].vocab_size
        cuda = args.device.startswith("cuda")
        sizes = [b for b in (1, 2, 4, 8, 16, 32, 64, 128, 256) if b < args.batch] + [args.batch]
        llm = LLM(model=args.preset, hf_overrides=overrides, tensor_parallel_size=args.tp, seed=0,
                  distributed_executor_backend="mp", device=args.device, dtype="bfloat16" if cuda else "float32",
                  max_num_seqs=max(64, args.batch), max_num_batched_tokens=max(2048, args.batch * args.prompt_len),
                  max_model_len=max(256, args.prompt_len + args.tokens),
                  **({"dummy_weights": "device", "cuda_graph_batch_sizes": sizes,
                      "kv_cache_memory_bytes": 4 << 30} if cuda else {}))
    else:
        ckpt = args.checkpoint
        if ckpt is None:
            from tests.anchors.checkpoint import write_hf_checkpoint

            tmp = tempfile.TemporaryDirectory(prefix="bench-ckpt-")
            ckpt = write_hf_checkpoint(tmp.name, seed=0, zero_rope=False)
        with open(os.path.join(ckpt, "config.json")) as f:
            vocab = json.load(f)["vocab_size"]
        llm = LLM(model=ckpt, tensor_parallel_size=args.tp, seed=0, distributed_executor_backend="mp",
                  max_num_seqs=max(64, args.batch))
    prompts = [{"prompt_token_ids": p} for p in bench_prompts(args.batch, args.prompt_len, vocab)]
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    best = None
    try:
        llm.generate(prompts, params)  # warm-up
        for _ in range(args.rounds):
            llm.collective_rpc("step_profile", "reset")
            t0 = time.perf_counter()
            llm.generate(prompts, params)
            wall = time.perf_counter() - t0
            stats = llm.collective_rpc("step_profile", "read")
            if best is None or wall < best[0]:
                best = (wall, stats)
    finally:
        llm.shutdown()
    wall, stats = best
    steps = args.tokens  # one prefill step + tokens - 1 decode steps
    model = args.preset or "anchor checkpoint"
    print(f"{model} on {args.device}, TP {args.tp}, batch {args.batch}, {args.tokens} tokens: best generate {wall * 1e3:.1f} ms "
          f"= {wall / steps * 1e3:.2f} ms/step over {steps} steps (timers on; load average "
          f"{open('/proc/loadavg').read().split()[:3]})")
    for r in stats:
        rows = sorted(r["stats"].items(), key=lambda kv: -kv[1][2])
        covered = sum(v[2] for v in r["stats"].values())
        print(f"\nrank {r['rank']}: per step, ms (inclusive / exclusive), calls per step")
        for name, (calls, inc, exc) in rows:
            print(f"  {name:<34} {inc / steps * 1e3:8.3f} {exc / steps * 1e3:8.3f} {calls / steps:6.1f}")
        print(f"  {'(timed, exclusive sum)':<34} {'':>8} {covered / steps * 1e3:8.3f}")
        print(f"  {'other (wall - timed)':<34} {'':>8} {(wall - covered) / steps * 1e3:8.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "wall_s": wall, "steps": steps, "ranks": stats}, f, indent=2)
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
