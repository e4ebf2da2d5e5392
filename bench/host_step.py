"""The host's share of a served decode step at many streams, against another revision in the same run.

On the H200 a 256-stream decode step's graph takes ~7 ms, and the host work around it took
another ~4-5 ms that the GPU waits for (run 47: schedule 1.3, postprocess 2.8, the graph's input
packing and launch 2.0 ms a step). This bench runs that host work without a GPU: `LLMEngine.step()`
with a model that costs nothing but the decode graphs' input packing (`cuda_graph`'s host side,
numpy only), then the rank-0 pipe's pickling of the step's outputs and the controller's
unpickling, as in `bench/stream_outputs.py` (progress outputs as deltas, as the engine loop
sends them; an `OutputBatch` where the revision has one), and the controller's extending of
each stream's whole output (`route`) and its SSE events (`events`). Each phase is timed per step.

With `--against REV` the same measurement also runs on the code of git revision REV (a temporary
worktree, its own process), the two alternating `--rounds` times; the last line gives each
phase's median and the ratio REV / this tree (above 1: this tree is faster).

    python bench/host_step.py [--streams 256] [--prompt-len 128] [--steps 64] [--vocab 2048]
        [--against HEAD~1] [--rounds 3] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pickle
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PHASES = ("schedule", "pack", "postprocess", "pickle", "unpickle", "route", "events", "total")


class SimulatedDevice:
    """A device that takes `ms` a step (--device-ms here, and bench/admission.py): the model calls
    `launched()` for each step it is given, which starts once the step before it is done; the
    engine's sampler, which reads the logits, waits until then (`attach`)."""

    def __init__(self, ms: float) -> None:
        self.ms = ms
        self.ready: list[float] = []  # when each launched step's logits would be ready

    def launched(self) -> None:
        self.ready.append(max(time.perf_counter(), self.ready[-1] if self.ready else 0.0) + self.ms / 1e3)

    def attach(self, engine) -> None:
        sample = engine.sampler

        def wait_then_sample(*a):  # sampling reads the logits: the host waits for the device here
            time.sleep(max(0.0, self.ready.pop(0) - time.perf_counter()))
            return sample(*a)

        engine.sampler = wait_then_sample


def accumulate(polled, route) -> list:
    """The HTTP controller's side of a poll (`Controller._poll_loop`): each stream's whole output
    extended by its delta through the controller's `Route`; the whole outputs, in order."""
    if not hasattr(polled, "ids"):  # an older revision polled a list of outputs
        return [route.accumulate(out) for out in polled]
    return [route.accumulate(out) if out is not None else route.advance(rid, token_ids, text, logprobs, version)
            for rid, out, token_ids, text, logprobs, version in polled]


def stream(done: list, views: dict, make_view, sse) -> None:
    """Each stream's SSE events for its output (`completions._stream`: the view's chunks)."""
    for w in done:
        view = views.get(w.request_id) or views.setdefault(w.request_id, make_view())
        if hasattr(view, "events"):
            view.events(0, w)
        else:  # an older revision encoded each chunk whole
            for chunk in view.chunks(0, w):
                sse(chunk)


def measure(args, overlap: bool = False, prepare: bool = False) -> dict:
    """ms a decode step for each phase (means over the steps), on the code under ROOT. `prepare`
    (with `overlap`): the graph inputs of a step scheduled ahead are packed, all but the token ids,
    while the step before it runs, as the rank-0 worker does (`DecodeInputs.prepare`)."""
    sys.path.insert(0, ROOT)
    import numpy as np
    import torch

    from service.engine.llm_engine import LLMEngine
    try:
        from service.model import decode_inputs as cuda_graph
    except ImportError:  # an older revision (--against): the host side was in cuda_graph
        from service.model import cuda_graph
    from service.sampling_params import SamplingParams
    from service.tokenizer import build_tiny_tokenizer
    try:
        from service.outputs import OutputBatch
    except ImportError:  # an older revision (--against): the poll sent its outputs as objects
        OutputBatch = None
    try:
        from service.server.route import Route
    except ImportError:  # an older revision (--against): Route lived in the controller
        from service.server.controller import Route
    from types import SimpleNamespace

    from service.server.completions import _sse, _View
    ctl = SimpleNamespace(stream_interval=1, model_name="small", token_text=str)

    tok = build_tiny_tokenizer(args.vocab)
    logits = torch.randn(args.streams, args.vocab, generator=torch.Generator().manual_seed(0))
    block = 16
    per_seq = -(-(args.prompt_len + args.steps) // block)
    width = per_seq
    buf = np.zeros(cuda_graph.buffer_len(args.streams, width), dtype=np.int64)
    scratch = (args.streams * per_seq + 16, args.streams)
    pack_s = [0.0, 0.0]  # on the critical path, ahead of it
    # The graphs' batch sizes: powers of two up to the streams (the padding rows are packed too).
    sizes = sorted({min(2 ** k, args.streams) for k in range(args.streams.bit_length() + 1)})
    # An older revision (--against) has no DecodeInputs: it packed the whole step each time.
    host = (cuda_graph.DecodeInputs(buf, sizes, width, block, scratch) if hasattr(cuda_graph, "DecodeInputs")
            else None)

    def model(plan):
        if all(len(c.token_ids) == 1 for c in plan.chunks):
            t0 = time.perf_counter()
            if host is not None:
                host.pack(plan.chunks)
            else:
                cuda_graph.pack_decode(plan.chunks, len(plan.chunks), args.streams, width, block, buf, scratch)
            pack_s[0] += time.perf_counter() - t0
        if device is not None:
            device.launched()
        return logits[:sum(c.needs_logits for c in plan.chunks)]

    device = SimulatedDevice(args.device_ms) if args.device_ms else None

    engine = LLMEngine(model, tok, block_size=block, num_blocks=args.streams * per_seq + 16,
                       max_num_seqs=args.streams, max_num_batched_tokens=args.streams * args.prompt_len,
                       max_model_len=args.prompt_len + args.steps, vocab_size=args.vocab, overlap=overlap)
    if prepare:
        def pack_ahead(plan):
            t0 = time.perf_counter()
            host.prepare(plan.chunks)
            pack_s[1] += time.perf_counter() - t0

        engine.prepare = pack_ahead
    engine.progress_deltas = True
    if device is not None:
        device.attach(engine)
    gc.collect()  # as the rank actor and the controller do once started (`gc.freeze`)
    gc.freeze()
    params = SamplingParams(temperature=0, max_tokens=args.steps, ignore_eos=True)
    for i in range(args.streams):
        engine.add_request(f"cmpl-{i:08x}", None, [5 + (i + j) % 1000 for j in range(args.prompt_len)], params)
    first = engine.step()  # the prefill
    pack_s[:] = [0.0, 0.0]
    for k in engine.step_seconds:
        engine.step_seconds[k] = 0.0
    dumps = loads = routed = events = wall = 0.0
    steps = 0
    route = Route(queue=None, loop=None)  # one route holds every stream's whole output here
    views: dict = {}
    accumulate(pickle.loads(pickle.dumps(OutputBatch(first) if OutputBatch else first)), route)
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        t1 = time.perf_counter()
        blob = pickle.dumps(OutputBatch(outs) if OutputBatch else outs)  # rank 0's poll reply
        t2 = time.perf_counter()
        got = pickle.loads(blob)
        t3 = time.perf_counter()
        done = accumulate(got, route)
        t4 = time.perf_counter()
        stream(done, views, lambda: _View(ctl, "completions", "cmpl-x", 0), _sse)
        t5 = time.perf_counter()
        events += t5 - t4
        wall += t1 - t0
        dumps += t2 - t1
        loads += t3 - t2
        routed += t4 - t3
        steps += 1
    sec = engine.step_seconds
    ms = {"schedule": sec["schedule"], "pack": pack_s[0], "postprocess": sec["postprocess"], "pickle": dumps,
          "unpickle": loads, "route": routed, "events": events,
          "pack_ahead": pack_s[1]}
    http = dumps + loads + routed + events
    ms["total"] = wall - sec["execute"] + pack_s[0] - sec["sample"] + http  # the sampler is the GPU's
    ms["step"] = wall + http  # the wall time of a step, device included (with --device-ms)
    return {k: v / steps * 1e3 for k, v in ms.items()} | {"steps": steps}


def compare_overlap(args) -> None:
    """Steps in order against async output processing, in this process, over a simulated device."""
    runs: dict[str, list[dict]] = {"in_order": [], "async_output": [], "packed_ahead": []}
    for r in range(args.rounds):
        for name in runs:
            runs[name].append(measure(args, overlap=name != "in_order", prepare=name == "packed_ahead"))
            print(f"[host-step] round {r + 1}/{args.rounds} {name}: step {runs[name][-1]['step']:.2f} ms "
                  f"(device {args.device_ms:g} ms)", flush=True)
    cols = (*PHASES, "pack_ahead", "step")
    med = {name: {p: statistics.median(x[p] for x in rs) for p in cols} for name, rs in runs.items()}
    ratio = med["in_order"]["step"] / med["async_output"]["step"]
    ahead = med["async_output"]["step"] / med["packed_ahead"]["step"]
    for name, m in med.items():
        print(f"{name:13s} step {m['step']:.3f} ms  " + " ".join(f"{p} {m[p]:.3f}" for p in cols[:-1]))
    print(f"async output: a step {ratio:.3f}x shorter than in order (device {args.device_ms:g} ms a step, simulated)")
    print(f"graph inputs packed ahead: a step {ahead:.3f}x shorter than async output without "
          f"({med['in_order']['step'] / med['packed_ahead']['step']:.3f}x in order's)")
    summary = {"args": vars(args), "median_ms": med, "in_order_over_async": ratio, "async_over_packed_ahead": ahead,
               "runs": runs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    print("SUMMARY " + json.dumps({"median_ms": med, "in_order_over_async": ratio, "async_over_packed_ahead": ahead}))


def worktree(rev: str) -> str:
    path = tempfile.mkdtemp(prefix="host_step_")
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", path, rev], check=True)
    shutil.copy(os.path.abspath(__file__), os.path.join(path, "bench", "host_step.py"))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--steps", type=int, default=128, help="output tokens per stream")
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--against", help="a git revision to measure in the same run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--device-ms", type=float, default=0.0,
                    help="a device that takes this long a step (the sampler waits for it): the step's wall time "
                         "with async output processing against steps in order, alternating --rounds times")
    ap.add_argument("--json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.device_ms and args.against:
        ap.error("--device-ms compares the two engine orders of this tree in one process; it takes no --against")
    if args.device_ms and not args.child:
        compare_overlap(args)
        return
    if args.child or not args.against:
        out = measure(args)
        print(json.dumps(out) if args.child else " ".join(f"{k} {v:.3f}" for k, v in out.items()), flush=True)
        return
    base = worktree(args.against)
    flags = [f"--streams={args.streams}", f"--prompt-len={args.prompt_len}", f"--steps={args.steps}",
             f"--vocab={args.vocab}", "--child"]
    runs: dict[str, list[dict]] = {"this": [], args.against: []}
    try:
        for r in range(args.rounds):
            for name, root in (("this", ROOT), (args.against, base)):
                res = subprocess.run([sys.executable, os.path.join(root, "bench", "host_step.py"), *flags],
                                     capture_output=True, text=True, check=True)
                runs[name].append(json.loads(res.stdout.strip().splitlines()[-1]))
                print(f"[host-step] round {r + 1}/{args.rounds} {name}: total {runs[name][-1]['total']:.2f} ms a step",
                      flush=True)
    finally:
        subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", base], check=False)
    med = {name: {p: statistics.median(x[p] for x in rs) for p in PHASES} for name, rs in runs.items()}
    ratio = {p: med[args.against][p] / med["this"][p] if med["this"][p] else float("nan") for p in PHASES}
    summary = {"args": vars(args), "median_ms": med, "ratio_against_over_this": ratio, "runs": runs}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    for p in PHASES:
        print(f"{p:12s} this {med['this'][p]:7.3f} ms   {args.against} {med[args.against][p]:7.3f} ms   "
              f"{ratio[p]:.2f}x")
    print("SUMMARY " + json.dumps({"median_ms": med, "ratio": ratio}))


if __name__ == "__main__":
    main()
