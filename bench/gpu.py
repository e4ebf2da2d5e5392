"""GPU serving bench (one H200): decode step vs the bandwidth floor, throughput vs transformers,
sleep bandwidth vs a pinned copy, level-2 wake, fused vs unfused tail. One command, one table:

    python3 bench/gpu.py --commit $(git rev-parse --short HEAD) [--json out.json]

- decode: `small` with 24 layers (8.2 GB of bf16 weights, latent MoE), KV contexts of
  --context tokens, batches 1/8/64/256, through the engine's CUDA graphs (`DecodeGraphs.run`:
  host packing + one copy + replay) and eagerly. Floor = bytes a step must read (every weight
  but the embedding table, of the routed experts only those the step's tokens chose, plus the
  KV contexts) over the device copy bandwidth measured here (bytes read + written per second).
  The same model is built four times in the run: the default (whole decoder layers compiled
  inside the graphs, Triton MoE router and GEMV experts), only the elementwise chains compiled
  (LATENTSERVE_COMPILE=chains), nothing compiled (LATENTSERVE_COMPILE=0), and the torch router
  and grouped-GEMM experts (LATENTSERVE_MOE_KERNELS=0); kernels per layer are counted by the
  profiler over one graph replay of each.
- throughput: `small` with the latent MoE off (plain DeepSeek-V3, 7.4 GB), the same weights in
  our engine and in transformers' DeepseekV3ForCausalLM, batch 16, greedy; decode tokens/s by
  the protocol of scripts/anchors/decode_bench.py (full run minus a prefill-only run).
- sleep: the decode model's own level-1 offload/restore against a pinned copy of the same
  bytes (bench/sleep.py's reference), then level-2 weights wake in ms per GiB mapped.
- prefill: one eager prefill step of 8 x 1024 tokens on the decode model, FLOPs counted from
  the config (bench/prefill_flops.py: projections, the experts each token chose, causal
  attention) over its time, against a bf16 8192^3 torch.matmul timed in the same run; profiler
  table and device time by kernel kind.
- tail: bench/tail.py's CUDA section at TP 2 (virtual ranks), when the Triton tail exists.
- k3: Kimi-K3 with its real layer shapes (hidden 7168, 96 KDA heads of 128, MLA with output
  gate, latent MoE 3584, SiTU, attention residuals) cut to fit one GPU (K3_BENCH: 8 layers, 32
  experts), decode eagerly (enforce_eager: its graphs are measured at small widths in k3graphs) against its floor:
  weights as above, MLA KV of the MLA layers only, and each KDA layer's state rows read and
  written once per sequence.
- k3graphs: a Kimi-K3-structured model at the `small` preset's widths (K3_SMALL: 24 layers, 18
  KDA + 6 MLA, 16 KDA heads of 128, latent MoE 1024 with 64 experts top 8, SiTU, attention
  residuals; ~8.5 GB bf16), decode through the CUDA graphs and eagerly at batches up to 64, with
  the speedup, against the same floor as k3.

Random weights are drawn on the GPU (the engine's TP-invariant CPU init would take minutes).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
import traceback
from functools import partial

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "scripts", "anchors"), os.path.join(ROOT, "bench")]

import service.weights as weights  # noqa: E402
import service.weights.checkpoint  # noqa: E402,F401
from service import LLM, SamplingParams  # noqa: E402
from service.engine.plan import SeqChunk, StepPlan  # noqa: E402
from service.model.attn_metadata import AttnMetadata  # noqa: E402
from service.model.model import K3_DECODE_SWITCHES  # noqa: E402
from service.weights import fp8  # noqa: E402

GIB = 1 << 30
MID = {"num_hidden_layers": 24}  # small x 2 layers: 8.2 GB bf16, latent MoE
PLAIN = {"moe_latent_size": None}  # small as plain DeepSeek-V3: 7.4 GB, loadable by transformers
# k3's shapes on one GPU: 6 KDA + 2 MLA layers (3:1 as K3), 32 of 896 experts (top 16): ~15 GB bf16.
K3_BENCH = {"num_hidden_layers": 8, "n_routed_experts": 32, "linear_attn_config": {
    "kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8], "num_heads": 96, "head_dim": 128,
    "short_conv_kernel_size": 4, "use_full_rank_gate": True}}
# Kimi-K3's structure (the `k3` preset: KDA + MLA 3:1, MLA NoPE with output gate, full-rank KDA
# gate, SiTU, latent MoE, attention residuals) at the `small` preset's widths.
K3_SMALL = {"vocab_size": 32768, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
            "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 768, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 64,
            "num_experts_per_tok": 8, "n_shared_experts": 1, "moe_intermediate_size": 768, "moe_latent_size": 1024,
            "max_position_embeddings": 8192, "linear_attn_config": {
                "kda_layers": [n for n in range(1, 25) if n % 4], "full_attn_layers": list(range(4, 25, 4)),
                "num_heads": 16, "head_dim": 128, "short_conv_kernel_size": 4, "use_full_rank_gate": True}}
RESULTS: dict = {}


def log(msg: str) -> None:
    print(f"[gpu-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- setup --------------------------------------------------------------------------------------

@torch.no_grad()
def device_dummy_init(model, cfg, tp, seed: int = 0) -> None:
    """Stand-in for weights.init_dummy_weights: the same kinds of values, drawn on the device."""
    kinds = {s.param: s.kind for s in weights.weight_specs(cfg)}
    gen = torch.Generator(device=model.model.norm.weight.device).manual_seed(seed)
    params = dict(model.named_parameters())
    block = fp8.fp8_block(cfg)
    for name, p in model.named_parameters():
        kind = kinds.get(name, "matrix")
        if name.endswith(fp8.SCALE_SUFFIX):
            continue  # written with its FP8 weight
        if p.dtype == fp8.FP8:  # the bf16 build's draw (same generator order), quantized
            w = torch.empty(p.shape, dtype=torch.bfloat16, device=p.device).normal_(0.0, cfg.initializer_range,
                                                                                     generator=gen)
            scale = params[name + fp8.SCALE_SUFFIX]
            q, sc = fp8.quantize(w, fp8.implied_block(tuple(p.shape), tuple(scale.shape)))
            p.copy_(q)
            scale.copy_(sc)
        elif kind == "norm":
            p.fill_(1.0)
        else:
            p.normal_(0.0, 0.01 if kind == "bias" else cfg.initializer_range, generator=gen)
            if block is not None and name.endswith(fp8.HELD_DEQUANTIZED):  # FP8 values, held in bf16
                p.copy_(fp8.fake_quantize(p, block))


def switched_llm(device: str, overrides: dict, preset: str, **kw) -> LLM:
    """make_llm for a build after another in this process under other LATENTSERVE_* switches: they
    are read while dynamo traces, and it does not guard on them, so without the reset this build
    would replay the earlier one's compiled layers."""
    torch._dynamo.reset()
    return make_llm(device, overrides, preset, **kw)


def measured(llm: LLM, fn):
    """fn(llm), then the engine shut down and its device memory given back, whatever happens: fn's
    locals are gone by then, so this is the last reference to the engine. Dynamo's compiled
    layers guard on the model's parameters and keep them alive, and the graphs' pools sit in
    reference cycles: without the reset and the collection, run 51 (an H100, 80 GB) ran out of
    memory at its fifth build of `small`."""
    try:
        return fn(llm)
    finally:
        llm.shutdown()
        del llm
        torch._dynamo.reset()
        gc.collect()
        torch.cuda.empty_cache()


def isolated(label: str, fn, **failed) -> dict:
    """fn(), or `failed` with the error when it raises: one failing candidate (run 47: gemv_256's
    tiles over shared memory) costs only its own rows of a bench."""
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        log(f"{label} failed: {type(e).__name__}: {str(e)[:300]}")
        return {**failed, "error": f"{type(e).__name__}: {e}"[:500]}


def make_llm(device: str, overrides: dict, preset: str, **kw) -> LLM:
    t0 = time.perf_counter()
    llm = LLM(model=preset, hf_overrides=overrides, dtype=kw.pop("dtype", "bfloat16"), device=device,
              distributed_executor_backend="uni", **kw)
    log(f"{preset} {overrides}: engine up in {time.perf_counter() - t0:.1f}s")
    return llm


def copy_bandwidth(device: str, nbytes: int = 4 * GIB, repeat: int = 10) -> float:
    """Bytes read + written per second of a device-to-device copy (median), launched eagerly: the
    baseline of every bench's "of copy bandwidth". Not in a CUDA graph, where the copy is a memcpy
    node: the H200 ran that at 2.75 TB/s against 4.2 TB/s eagerly (2026-12-04)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    times = [timed(partial(dst.copy_, src), device) for _ in range(repeat + 2)]
    return 2 * nbytes / statistics.median(times[2:])


@contextlib.contextmanager
def switches(env: dict[str, str]):
    """The LATENTSERVE_* switches in `env` set for the block, restored after."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def sync(device: str) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def timed(fn, device: str, n: int = 1) -> float:
    """Seconds per call of fn over n back-to-back calls."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / n


# ---- decode step vs floor ----------------------------------------------------------------------

def decode_chunks(batch: int, context: int, block_size: int, token: int = 5) -> list[SeqChunk]:
    per = -(-(context + 1) // block_size)
    return [SeqChunk(i, [token + i], context, list(range(i * per, (i + 1) * per)), state_slot=i)
            for i in range(batch)]


@contextlib.contextmanager
def eager(worker):
    """The worker's steps without any CUDA graph (decode or prefill graphs) inside the block."""
    saved = worker.decode_graphs, worker.prefill_graphs
    worker.decode_graphs = worker.prefill_graphs = None
    try:
        yield
    finally:
        worker.decode_graphs, worker.prefill_graphs = saved


def active_expert_bytes(worker, chunks) -> tuple[int, int]:
    """(bytes of the routed experts this step's tokens chose, summed over layers; layers)."""
    from service.model.moe import FusedExperts

    seen: list[int] = []

    def record(mod, ids: torch.Tensor) -> None:
        seen.append(int(ids.unique().numel()) * (mod.w13[0].numel() + mod.w2[0].numel()) * mod.w2.element_size())

    def counted_parts(mod):
        # From two rows at TP 1 the experts run through `parts` (the slot-sum-norm path), not
        # forward: run 66 (H100) counted no expert at batch 8-256 and gave a floor without them.
        parts = mod.parts

        def run(x, weights, ids):
            out = parts(x, weights, ids)
            if out is not None:
                record(mod, ids)
            return out
        return run

    experts = [m for m in worker.model.modules() if isinstance(m, FusedExperts)]
    hooks = [m.register_forward_hook(lambda mod, args, out: record(mod, args[2])) for m in experts]
    for m in experts:
        m.parts = counted_parts(m)
    try:
        with eager(worker):  # hooks do not fire inside graph replays
            worker.execute(StepPlan(chunks))
    finally:
        for h in hooks:
            h.remove()
        for m in experts:
            del m.parts  # the class's method again
    return sum(seen), len(seen)


def step_bytes(floor: dict) -> int:
    """What a step must read (step_floor_bytes' parts): its floor is this over the bandwidth."""
    return floor["dense"] + floor["experts_read"] + floor["kv"] + floor["embed_rows"]


def step_floor_bytes(worker, chunks) -> dict:
    from service.model.moe import FusedExperts

    model = worker.model
    expert_ids = {id(p) for m in model.modules() if isinstance(m, FusedExperts) for p in m.parameters()}
    embed = model.model.embed_tokens.weight
    dense = sum(p.numel() * p.element_size() for p in model.parameters()
                if id(p) not in expert_ids and p is not embed)
    experts_all = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) in expert_ids)
    experts_read, counted = active_expert_bytes(worker, chunks)
    moe_layers = sum(isinstance(m, FusedExperts) for m in model.modules())
    if counted != moe_layers:  # a path the count does not see: run 66's floors left every expert out
        print(f"FLOOR INVALID: the routed experts were counted in {counted} of {moe_layers} MoE layers "
              "(a new expert path that active_expert_bytes does not see?); floors print as nan",
              file=sys.stderr, flush=True)
        experts_read = float("nan")
    cfg = model.config
    kv = sum(c.start_pos + 1 for c in chunks) * cfg.kv_cache_dim * len(cfg.mla_layers) * embed.element_size()
    state = 0  # KDA rows: read and written once per sequence
    for cache in worker.kv_caches:
        if not isinstance(cache, torch.Tensor):
            state += 2 * len(chunks) * sum(t[0].numel() * t.element_size() for t in (cache.conv, cache.recurrent))
    return {"dense": dense, "experts_read": experts_read, "experts_all": experts_all, "kv": kv + state,
            "embed_rows": len(chunks) * embed.shape[1] * embed.element_size()}


def profile_eager_step(worker, chunks, device: str, top: int = 12) -> str:
    from torch.profiler import ProfilerActivity, profile

    with eager(worker):
        plan = StepPlan(chunks)
        worker.execute(plan)
        sync(device)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            worker.execute(plan)
            sync(device)
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    kernel_us = sum(e.time_range.elapsed_us() for e in events)
    table = prof.key_averages().table(sort_by="device_time_total", row_limit=top, max_name_column_width=60)
    return (f"eager step, batch {len(chunks)}: {len(events)} GPU kernels/copies, {kernel_us / 1e3:.2f} ms of "
            f"device time\n{table}")


def decode_llm(args, batches: list[int] | None = None, **kw) -> LLM:
    """The decode bench's engine, with real numbers in every KV slot a context reads; graphs
    captured at exactly the benched batch sizes (`batches`, a baseline's share of them; the
    engine's sequence limit stays the run's)."""
    t0 = time.perf_counter()
    llm = switched_llm(args.device, MID, args.preset, max_num_seqs=max(args.batches),
                       cuda_graph_batch_sizes=sorted(batches or args.batches), kv_cache_memory_bytes=args.kv_gib * GIB,
                       **kw)
    build = (f"compile={os.environ.get('LATENTSERVE_COMPILE', 'layers')},"
             f"moe_kernels={os.environ.get('LATENTSERVE_MOE_KERNELS', '1')},"
             f"moe_grouped={os.environ.get('LATENTSERVE_MOE_GROUPED', 'triton')}")
    RESULTS.setdefault("engine_up_s", {})[build] = time.perf_counter() - t0
    fill_caches(llm)
    return llm


def fill_caches(llm: LLM) -> None:
    """Real numbers in every KV slot a context reads; KDA state rows start from zero."""
    with torch.no_grad():
        for cache in llm.executor.rank0.kv_caches:
            if isinstance(cache, torch.Tensor):
                cache.normal_()
            else:
                cache.conv.zero_()
                cache.recurrent.zero_()


def decode_case(llm: LLM, batch: int, context: int) -> tuple[dict, int, StepPlan]:
    """A step of `batch` decodes at `context`: its floor's parts, the bytes it must move, its plan."""
    chunks = decode_chunks(batch, context, llm.config.block_size)
    floor = step_floor_bytes(llm.executor.rank0, chunks)
    return floor, step_bytes(floor), StepPlan(chunks)


def bench_k3(args, bw: float) -> None:
    """Kimi-K3's shapes cut to one GPU: eager decode step vs its floor."""
    batches = [b for b in args.batches if b <= 64]
    llm = make_llm(args.device, K3_BENCH, "k3", max_num_seqs=max(batches), kv_cache_memory_bytes=2 * GIB,
                   enforce_eager=True)
    fill_caches(llm)
    worker, rows = llm.executor.rank0, []
    for batch in batches:
        floor, need, plan = decode_case(llm, batch, args.context)
        with torch.inference_mode():
            worker.execute(plan)
            ms = timed(partial(worker.execute, plan), args.device, max(3, args.iters // 5)) * 1e3
        row = {"batch": batch, "bytes": need, "floor_ms": need / bw * 1e3, "eager_ms": ms,
               "floor_fraction": need / bw * 1e3 / ms, **floor}
        rows.append(row)
        log(f"k3 decode batch {batch}: {json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})}")
    RESULTS["k3"] = {"overrides": K3_BENCH, "graphs": str(worker.decode_graphs), "decode": rows}
    llm.shutdown()


# Kimi-K3's decode candidates, timed in one process against `none` (the defaults): each build
# after the first finds Inductor's and Triton's caches warm, where a process each recompiled cold
# (run 48: `none`, first, ran out of a quarter of the call).
K3_CONFIGS = {"none": {},
              # the path before run 61 made K3's four decode kernels the defaults (run 61: `all`, these
              # four, 0.71x / 0.75x / 0.80x of it at batch 1 / 8 / 64): FLA's recurrent kernel, a
              # launch a projection, the attention-residual mixes and MLA's gate as torch chains
              "fla": {name: "0" for name in K3_DECODE_SWITCHES},
              # the step kernel's state in 64-column blocks on 8 warps up to 8 sequences (kda_step.block_cols)
              "step_wide": {"LATENTSERVE_KDA_STEP_WIDE_MAX_ROWS": "8"},
              # a head's columns over four programs up to 8 sequences (kda_step.split_max_rows)
              "step_split": {"LATENTSERVE_KDA_STEP_SPLIT_MAX_ROWS": "8"},
              # Under PDL a kernel's profiled time includes its wait for the one before (run 48: the
              # GEMVs' total rose 308 -> 422 us at batch 1 behind the step kernel); without, each its own.
              "no_pdl": {"LATENTSERVE_PDL": "0"}}


def bench_k3_graphs(args, bw: float) -> None:
    """K3_SMALL: decode step through the CUDA graphs and eagerly, same engine, same steps, for each
    of --k3-configs (K3_CONFIGS), the ratios against the first in the same run."""
    out = {"overrides": K3_SMALL}
    first = None
    for name in args.k3_configs:
        out[name] = isolated(f"k3-small {name}", partial(k3_graphs_rows, args, bw, name))
        if "error" in out[name]:
            continue
        first = first or name
        for row, base in zip(out[name]["decode"], out[first]["decode"]):
            row[f"over_{first}"] = row["graph_ms"] / base["graph_ms"]
        log(f"k3-small {name} over {first} (graph ms): "
            f"{ {r['batch']: round(r[f'over_{first}'], 3) for r in out[name]['decode']} }")
    RESULTS["k3graphs"] = out


def k3_graphs_rows(args, bw: float, name: str) -> dict:
    """K3_SMALL built under K3_CONFIGS[name], without prefill graphs: decode steps never replay
    them, and they were ~12 s of each build."""
    batches = [b for b in args.batches if b <= 64]
    with switches({"LATENTSERVE_PREFILL_GRAPHS": "0", **K3_CONFIGS[name]}):
        return measured(switched_llm(args.device, K3_SMALL, "k3", max_num_seqs=max(batches),
                                     cuda_graph_batch_sizes=batches, kv_cache_memory_bytes=2 * GIB),
                        partial(_k3_rows, args, bw, name, batches))


def _k3_rows(args, bw: float, name: str, batches: list[int], llm: LLM) -> dict:
    fill_caches(llm)
    worker, rows = llm.executor.rank0, []
    graphs = worker.decode_graphs
    nan = float("nan")
    for batch in batches:
        _, need, plan = decode_case(llm, batch, args.context)
        with torch.inference_mode():
            graph_ms = nan
            if graphs is not None:
                worker.execute(plan)
                graph_ms = timed(partial(worker.execute, plan), args.device, args.iters) * 1e3
            with eager(worker):
                worker.execute(plan)
                eager_ms = timed(partial(worker.execute, plan), args.device, max(3, args.iters // 5)) * 1e3
        row = {"batch": batch, "bytes": need, "floor_ms": need / bw * 1e3, "graph_ms": graph_ms, "eager_ms": eager_ms,
               "speedup": eager_ms / graph_ms, "floor_fraction": need / bw * 1e3 / min(graph_ms, eager_ms)}
        if graphs is not None and batch in args.profile_batches:  # where a K3 step's kernels go
            prof = profile_replay(graphs, batch, len(worker.model.layers))
            print(f"k3-small {name}, batch {batch}:\n{prof['table']}", flush=True)
            row["kernels_per_layer"] = prof["kernels_per_layer"]
        rows.append(row)
        log(f"k3-small decode {name} batch {batch}: "
            f"{json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})}")
    return {"env": K3_CONFIGS[name], "graphs": graphs.stats() if graphs else "off", "decode": rows}


def profile_replay(graphs, batch: int, layers: int, top: int = 14) -> dict:
    """Kernels of one replay of the batch's graph, counted by the profiler (CUPTI records the
    kernels a graph launches), and their device time."""
    from torch.profiler import ProfilerActivity, profile

    g = graphs.graphs[graphs.batch_for(batch)]
    g.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        g.replay()
        torch.cuda.synchronize()
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    kernel_us = sum(e.time_range.elapsed_us() for e in events)
    table = prof.key_averages().table(sort_by="device_time_total", row_limit=top, max_name_column_width=70)
    # Every kernel name with its launches: per-layer kernels come 23-24 times a step (one dense
    # layer), the rest (embedding, final norm, lm_head) once, which kernels_per_layer includes.
    counts: dict[str, int] = {}
    us: dict[str, float] = {}
    for e in events:
        counts[e.name] = counts.get(e.name, 0) + 1
        us[e.name] = us.get(e.name, 0.0) + e.time_range.elapsed_us()
    exposed, idle_us = critical_path(events)
    return {"batch": batch, "kernels": len(events), "kernels_per_layer": len(events) / layers,
            "device_ms": kernel_us / 1e3, "table": table, "kernel_counts": counts, "kernel_us": us,
            "exposed_us": exposed, "idle_us": idle_us}


def critical_path(events) -> tuple[dict[str, float], float]:
    """Under PDL a kernel starts before the one ahead of it ends, so profiled durations overlap
    and do not add up to the step. A kernel's exposed time is how far it moved the step's end:
    from the latest end of the kernels started before it (or its own start, after an idle gap)
    to its own end. Exposed times and idle gaps sum to the replay's span, so they say what each
    kernel costs the step with PDL on: (us by kernel name, idle us)."""
    events = sorted(events, key=lambda e: e.time_range.start)
    exposed: dict[str, float] = {}
    frontier, idle = (events[0].time_range.start if events else 0.0), 0.0
    for e in events:
        start, end = e.time_range.start, e.time_range.end
        idle += max(0.0, start - frontier)
        exposed[e.name] = exposed.get(e.name, 0.0) + max(0.0, end - max(frontier, start))
        frontier = max(frontier, end)
    return exposed, idle


def per_layer_table(prof: dict, layers: int, top: int = 14, key: str = "kernel_us") -> str:
    """us a layer and us a launch of each kernel (the step's total over the layers), largest first;
    key="exposed_us": what each costs the step under PDL (`critical_path`)."""
    us, counts = prof[key], prof["kernel_counts"]
    rows = [f"  {name[:62]:62s} {t / layers:8.1f} us/layer {t / counts[name]:8.1f} us x {counts[name]}"
            for name, t in sorted(us.items(), key=lambda kv: -kv[1])[:top]]
    return "\n".join(rows)


def mode_graph_ms(args, env: dict[str, str], **kw) -> dict:
    """Decode graph step ms per batch, and replay profiles, of the same model built under `env`
    (LATENTSERVE_COMPILE=0: nothing compiled, =chains: only the elementwise chains;
    LATENTSERVE_MOE_KERNELS=0: the torch router and grouped-GEMM experts). Without prefill graphs,
    which decode steps never replay: their capture was ~12 s of each build (run 45)."""
    with switches({"LATENTSERVE_PREFILL_GRAPHS": "0", **env}):
        ms, profiles = measured(decode_llm(args, **kw), partial(_graph_ms, args, kw.get("batches")))
    log(f"decode with {env} (graph ms): {ms}; kernels per layer: "
        f"{ {p['batch']: round(p['kernels_per_layer'], 1) for p in profiles} }")
    return {"ms": ms, "profiles": profiles}


def _graph_ms(args, batches: list[int] | None, llm: LLM) -> tuple[dict, list]:
    worker, ms, profiles = llm.executor.rank0, {}, []
    layers = len(worker.model.layers)
    for batch in [b for b in args.batches if b in (batches or args.batches)]:
        plan = StepPlan(decode_chunks(batch, args.context, llm.config.block_size))
        with torch.inference_mode():
            worker.execute(plan)
            ms[batch] = timed(partial(worker.execute, plan), args.device, args.iters) * 1e3
            if batch in args.profile_batches and worker.decode_graphs is not None:
                profiles.append(profile_replay(worker.decode_graphs, batch, layers))
    return ms, profiles


# The FP8 build is timed against these (--fp8-baselines). fp8_wide_tiles: FP8 projections of
# 2-64 rows on the W8A16 kernel's 64-wide output tiles, as before fp8.dot_config; fp8_gemv_256:
# the GEMV's tiles up to 256 rows, where W8A8 (activations quantized) runs from 128 by default.
FP8_BASELINES = {"fp8_wide_tiles": {"LATENTSERVE_FP8_GEMV_MAX_ROWS": "1"},
                 "fp8_gemv_256": {"LATENTSERVE_FP8_GEMV_MAX_ROWS": "256", "LATENTSERVE_FP8_W8A8_MIN_ROWS": "100000"},
                 # the MoE entry kernel off: FP8 layers' latent down, router, shared gate/up and activation
                 # as separate launches, and the shared down apart from the latent up (the pair runs on
                 # the entry's path), as before both took FP8 weights (2026-12-05)
                 "fp8_no_entry": {"LATENTSERVE_MOE_ENTRY": "0"},
                 # FP8's grouped experts in the 128-wide K steps bf16 took from run 112's sweep (FP8 keeps 64
                 # until this is timed: its weight tiles become fp32 registers, 92 -> 128 a gate/up program)
                 "fp8_grouped_k128": {"LATENTSERVE_MOE_FP8_GROUPED_MAX_K": "128"}}

# The default build (layers compiled, Triton MoE kernels) is timed against these, same model.
# torch_grouped: torch._grouped_mm above the GEMV limit instead of the Triton grouped GEMM
# (service/model/moe_grouped.py); the same build as the default at batches <= 16.
# "batches": a baseline built and timed at only those of the run's batches (a switch that acts at
# one row costs a lease no graphs at 8-256). same_build: the default itself, built and timed first.
# Its ratio is the run's noise and drift:
# in run 53 every baseline that does not act at 64 or 256 sequences came out 0.99x of the default,
# which is timed last.
BASELINES = {"same_build": {}, "uncompiled": {"LATENTSERVE_COMPILE": "0"}, "chains": {"LATENTSERVE_COMPILE": "chains"},
             "torch_moe": {"LATENTSERVE_MOE_KERNELS": "0"},
             "torch_grouped": {"LATENTSERVE_MOE_GROUPED": "torch"}, "cublas_gemv": {"LATENTSERVE_GEMV_MAX_ROWS": "0"},
             "separate_moe_entry": {"LATENTSERVE_MOE_ENTRY": "0"}, "no_pdl": {"LATENTSERVE_PDL": "0"},
             # The MoE entry kernel's 2-16 rows as 16 outputs a program at 3 stages, the default before
             # run 105 made 32 at 4 the default (with `small_stack`; run 62's sweep at 8 rows: 1.09x
             # standalone; moe_entry._rows_launch).
             "entry_narrow_n": {"LATENTSERVE_MOE_ENTRY_WIDE_N": "0"},
             # The build before the opaque cuBLAS products (dense_mm.py, the default since run 83):
             # Inductor's addmm copies the residual first, 2 copies of 1.6 us a MoE layer at 256 rows.
             "addmm": {"LATENTSERVE_OPAQUE_MM": "0"},
             # Gate/up's programs lay out their own row blocks from the router's ids up to 128 pairs, no
             # align launch (moe_grouped.align_in_max_pairs, the default since run 70): `align_kernel`
             # is the build before it; 512 pairs takes batch 64 too, every program reading 512 ids.
             "align_kernel": {"LATENTSERVE_MOE_ALIGN_IN_MAX_PAIRS": "0"},
             "align_in_512": {"LATENTSERVE_MOE_ALIGN_IN_MAX_PAIRS": "512"},
             # MLA decode at 1-8 sequences in 16 warps (mla_decode.launch_config), and (`small_batch`)
             # with the half-size tiles below: what each alone is too small to show.
             "mla_16_warps": {"LATENTSERVE_MLA_SMALL_WARPS": "16"},
             # MLA decode at 1-8 sequences in half-size tiles at 3 stages (mla_decode.launch_config):
             # a program's KV load under its math; predicted 0.98-0.99x at batch 8, ~1.00x at 1;
             # run 106 (H100): 1.00x / 0.99x / 1.00x / 1.00x.
             "mla_small_pipeline": {"LATENTSERVE_MLA_SMALL_PIPELINE": "1"},
             "small_batch": {"LATENTSERVE_MLA_SMALL_WARPS": "16", "LATENTSERVE_MLA_SMALL_PIPELINE": "1"},
             "no_inductor_pdl": {"LATENTSERVE_INDUCTOR_PDL": "0"}, "bmm_absorb": {"LATENTSERVE_MLA_ABSORB": "0"},
             "separate_kv_write": {"LATENTSERVE_MLA_WRITE_KV": "0"}, "unpaired_tail": {"LATENTSERVE_GEMV_PAIR": "0"},
             # MLA decode's launch table before block tables were prefetched (mla_decode.launch_config).
             "mla_no_prefetch": {"LATENTSERVE_MLA_PREFETCH": "0"},
             # The MoE entry kernel at one row only, separate launches from 2 rows (the default before
             # run 43), and its one-row programs in 512-wide K steps (likewise).
             "entry_one_row": {"LATENTSERVE_MOE_ENTRY_MAX_ROWS": "1"},
             "entry_k512": {"LATENTSERVE_MOE_ENTRY_WHOLE_K": "0"},
             # The entry kernel up to 64 rows only (before run 45; since then up to 256 in 64-row blocks).
             "entry_rows_64": {"LATENTSERVE_MOE_ENTRY_MAX_ROWS": "64"},
             # The GEMV experts up to 16 tokens (the default before run 45; since then the grouped
             # GEMM from 5 tokens in bf16).
             "experts_gemv_at_8": {"LATENTSERVE_MOE_GROUPED_FROM_TOKENS": "17"},
             # The latent MoE's RMS norm as its own kernel before the paired GEMV at one row too (the
             # default before run 46), and inside it up to 64 rows (run 46: 1.02-1.03x slower at 8-64).
             "pair_norm_off": {"LATENTSERVE_GEMV_PAIR_NORM_MAX_ROWS": "0"},
             "pair_norm_64": {"LATENTSERVE_GEMV_PAIR_NORM_MAX_ROWS": "64"},
             # At one row the experts' slot sum as a kernel of its own, not inside the paired GEMV (the
             # default before run 105; the pair took it at 0.99x in runs 51 and 58, inside their noise).
             "pair_slots_off": {"LATENTSERVE_GEMV_PAIR_SLOTS": "0"},
             # MLA's split merge and W_UV as separate kernels at one sequence (default 1 since run 47),
             # and the merged kernel up to 8 sequences (run 47: 1.04x slower at batch 8).
             "merge_out_off": {"LATENTSERVE_MLA_MERGE_OUT_MAX_ROWS": "0"},
             "merge_out_8": {"LATENTSERVE_MLA_MERGE_OUT_MAX_ROWS": "8"},
             # MLA's absorb kernels in 64-wide K steps throughout (before run 47; since then up to 256
             # wide up to 16 sequences, the first step before the PDL wait).
             "absorb_narrow_k": {"LATENTSERVE_MLA_ABSORB_WIDE_K_MAX_ROWS": "0"},
             # The GEMV (and its pairs) up to 256 rows in 64-row blocks, where cuBLAS runs the
             # projections above 64 (run 51: 1.00x at batch 256, opt-in).
             "gemv_256": {"LATENTSERVE_GEMV_MAX_ROWS": "256"},
             # The expert selection on 4 warps without the chosen scores' reload (the default before
             # run 105; one warp with the reload, moe_select.launch_options, was 0.98x at batch 1 in
             # runs 53 and 58, 0.99-1.00x above), and on 4 warps with the reload.
             "select_4_warps": {"LATENTSERVE_ROUTE_SELECT_WARPS": "0", "LATENTSERVE_ROUTE_SELECT_GATHER": "0"},
             "select_4_warps_gather": {"LATENTSERVE_ROUTE_SELECT_WARPS": "0"},
             # The latent norm as a kernel of its own after the experts' slot sum (the default before
             # 2026-12-06; runs 53 and 58 timed the fused form at 0.99-1.01x, a launch a layer fewer).
             "slot_norm_off": {"LATENTSERVE_MOE_SLOT_NORM": "0"},
             # q's rope inside the MLA decode kernel in decode-only steps (run 53: 1.02x at batch 1,
             # 0.99x above, a kernel a layer fewer).
             "rope_in_decode": {"LATENTSERVE_MLA_ROPE_IN_DECODE": "1"},
             # The MLA absorb kernels' tiles above 16 rows by the fewest bytes through the busiest SM
             # (mla_absorb.l2_tiles; run 58: 1.00-1.01x).
             "absorb_l2_tiles": {"LATENTSERVE_MLA_ABSORB_L2_TILES": "1"},
             # The router's per-token logits kernel at every decode batch (moe_kernels.tiled_logits_tokens).
             "per_token_router": {"LATENTSERVE_ROUTE_TILED_TOKENS": "1000000000"},
             # The GEMV at one row only (its register product), cuBLAS from 2 rows: the default before
             # the tensor-core tiles (gemv.dot_config).
             "gemv_1_row": {"LATENTSERVE_GEMV_MAX_ROWS": "1"},
             # The GEMV's tensor-core tiles up to 16 rows only, cuBLAS above (run 35's default).
             "gemv_16_rows": {"LATENTSERVE_GEMV_MAX_ROWS": "16"},
             # The one-row GEMV in 512-wide K steps (the default before whole-K slices, run 39).
             "gemv_k512": {"LATENTSERVE_GEMV_MAX_K": "512"},
             # 2-16 rows' tensor-core tiles in 512-wide K steps (gemv.dot_max_k): twice the weight
             # bytes in flight an SM; predicted 0.98-0.99x at batch 8, nothing at 1, 64 or 256.
             "gemv_dot_k512": {"LATENTSERVE_GEMV_DOT_MAX_K": "512"},
             # 16-row tensor-core tiles for wide outputs too (gemv.dot_config before run 41).
             "gemv_narrow_tiles": {"LATENTSERVE_GEMV_WIDE_TILES": "0"},
             # The four decode changes of 2026-12-03's last session off at once (their sum).
             "fusions_off": {"LATENTSERVE_INDUCTOR_PDL": "0", "LATENTSERVE_MLA_ABSORB": "0",
                             "LATENTSERVE_MLA_WRITE_KV": "0", "LATENTSERVE_GEMV_PAIR": "0"},
             # Keys not LATENTSERVE_* are the engine's arguments. KV blocks of 32 slots alone (the
             # control), then with MLA decode's tiles copied by TMA from inside a block
             # (mla_decode_tma.py): predicted 0.95-0.97x at batch 256, 0.97-0.98x at 64, nothing at 1-8;
             # measured (run 101, H100) 1.00x / 0.99x / 1.00x / 0.99x, the control 1.00x.
             # The opt-in switches that each came out 0.98-0.99x at one batch in two or three runs,
             # inside that run's noise (select_lean and pair_slots at batch 1, entry_wide_n at 8),
             # together: ~0.97x at batch 1 and ~0.98x at 8 if their gains add, 1.00x at 64 and 256.
             # Run 105 (H100): 0.97x / 0.99x / 0.99x / 0.98x, run 106 0.97x / 0.98x / 0.99x / 0.99x:
             # the defaults since; this is the build before them.
             "small_stack_off": {"LATENTSERVE_ROUTE_SELECT_WARPS": "0", "LATENTSERVE_ROUTE_SELECT_GATHER": "0",
                                 "LATENTSERVE_GEMV_PAIR_SLOTS": "0", "LATENTSERVE_MOE_ENTRY_WIDE_N": "0"},
             # At one row, the residual add and RMS norm before attention inside fused_qkv_a's GEMV
             # and the one before the MoE inside its entry kernel (add_norm.py): two Inductor kernels
             # a layer fewer. The default since runs 105-106 (H100: batch 1 0.95x, 0.96x); this is
             # the control. Its 2-16 row kernels lost (1.37x at batch 8) and are gone (runs 107-108,
             # bench/norm_in_loop.py).
             "fold_add_norm_off": {"LATENTSERVE_FOLD_ADD_NORM": "0"},
             # The grouped experts' table row for up to 12 pairs an expert (batches 8-96) before runs
             # 112-115 moved its K step to 128: the build before at 8 and 64. Not at 256 (the table has
             # 64-row blocks there) nor at 97-192 (the old table had 32-row blocks there).
             "grouped_k64": {"LATENTSERVE_MOE_GROUPED_CONFIG": "16,64,64,4,4"},
             # MLA decode's split kernel at 1-8 sequences in Triton, as before the CUDA C one (mla_cuda.py;
             # run 122, H100: the default 0.95x of this at batch 1, 0.98x at 8).
             "mla_cuda_off": {"LATENTSERVE_MLA_CUDA_MAX_ROWS": "0"},
             # The CUDA C split kernel at 32 splits: at 8 sequences one tile a program in 256 programs where
             # the default (the Triton kernel's count, 16) gives two in 128. Runs 119-120 (H100): 3.320 and
             # 3.387 ms against 3.356-3.366 at 16; within the runs' noise. 16 and 8 splits at one
             # sequence lost (1.06x, 1.09x), the kernel at 64/256 sequences too (1.00x, 1.01x).
             "mla_cuda_32_splits": {"LATENTSERVE_MLA_CUDA_MAX_ROWS": "8", "LATENTSERVE_MLA_CUDA_SPLITS": "32"},
             # The decode GEMVs at 1-16 rows in Triton, as before the CUDA C GEMV (gemv_cuda.py; run 120,
             # H100: the default 0.99x of this at batch 1, 0.97x at 8).
             "gemv_cuda_off": {"LATENTSERVE_GEMV_CUDA_MAX_ROWS": "0"},
             # 8 warps on K in the CUDA C GEMV (gemv_cuda.k_warps): a K of 2048 all requested before the
             # PDL wait. Predicted: fused_qkv_a and o_proj ~0.5 us faster each at 1-8 rows, the pair
             # (K 1024 + 768) a little; batch 1 and 8 ~0.99x.
             "gemv_cuda_k8": {"LATENTSERVE_GEMV_CUDA_K_WARPS": "8"},
             # Below 32 pairs the experts' down kernel with its weight slab loaded before the PDL wait
             # (moe_down_early.py): the routing comes from two kernels back. Predicted 0.96-0.99x at batch 1
             # (the down kernel's ~7 us a layer toward its ~4.2 us of bytes), 1.00x at 8-256 (not taken).
             "moe_down_early": {"LATENTSERVE_MOE_DOWN_EARLY": "1", "batches": [1]},
             "moe_down_early_32": {"LATENTSERVE_MOE_DOWN_EARLY": "32", "batches": [1]},
             # At one row the latent MoE's pair GEMV requests its second weight (the shared experts' down
             # projection, 3.1 MB at small) before the PDL wait too (gemv.pair_early). Predicted 0.99-1.00x
             # at batch 1, 1.00x above (not taken).
             "gemv_pair_early": {"LATENTSERVE_GEMV_PAIR_EARLY": "1", "batches": [1]},
             # At one row the MoE entry kernel's last router program to finish chooses the experts
             # (moe_entry.select_enabled), where the selection kernel ran on its own (2.4 us a layer exposed,
             # run 117). Predicted 0.97-0.98x at batch 1, 1.00x above (not taken).
             "entry_select": {"LATENTSERVE_MOE_ENTRY_SELECT": "1", "batches": [1]},
             # At one row q_a's norm inside each q_b program and the latent row (c_kv's norm, the key's
             # rope) in one more program of that launch (qb_norms.py): two Inductor kernels a layer fewer
             # (~1 us each exposed, run 117). Predicted 0.97-0.98x at batch 1.
             "qb_norms": {"LATENTSERVE_MLA_QB_NORMS": "1", "batches": [1]},
             "kv_block_32": {"block_size": 32},
             "mla_tma": {"LATENTSERVE_MLA_TMA": "1", "block_size": 32},
             "mla_tma_64": {"LATENTSERVE_MLA_TMA": "1", "block_size": 64}}


def bench_decode(args, bw: float) -> LLM:
    def build(spec: dict) -> dict:
        env = {k: v for k, v in spec.items() if k.startswith("LATENTSERVE_")}
        return mode_graph_ms(args, env, **{k: v for k, v in spec.items() if k not in env})

    baselines = {name: isolated(f"baseline {name}", partial(build, spec), ms={}, profiles=[])
                 for name, spec in BASELINES.items() if name in args.baselines}
    RESULTS["baselines"] = baselines
    import torch._dynamo.utils as dynamo_utils

    llm = decode_llm(args, enable_sleep_mode="sleep" not in args.skip)
    worker = llm.executor.rank0
    graphs = worker.decode_graphs
    stats = graphs.stats() if graphs else "off"
    RESULTS["graph_stats"] = stats
    RESULTS["dynamo"] = {k: dict(v) for k, v in dynamo_utils.counters.items() if k in ("stats", "graph_break")}
    log(f"decode graphs: {stats}; dynamo: {RESULTS['dynamo']}")
    bs = llm.config.block_size
    layers = len(worker.model.layers)
    rows = []
    for batch in args.batches:
        chunks = decode_chunks(batch, args.context, bs)
        floor = step_floor_bytes(worker, chunks)
        need = step_bytes(floor)
        row = {"batch": batch, "context": args.context, "bytes": need, "floor_ms": need / bw * 1e3,
               "all_weights_floor_ms": (floor["dense"] + floor["experts_all"] + floor["kv"]) / bw * 1e3, **floor}
        plan = StepPlan(chunks)
        with torch.inference_mode():
            worker.execute(plan)
            if graphs is not None:
                b = graphs.batch_for(batch)
                row["graph_ms"] = timed(partial(worker.execute, plan), args.device, args.iters) * 1e3
                for name, other in baselines.items():
                    row[f"{name}_graph_ms"] = other["ms"].get(batch, float("nan"))
                row["replay_ms"] = timed(graphs.graphs[b].replay, args.device, args.iters) * 1e3
                if batch in args.profile_batches:
                    prof = profile_replay(graphs, batch, layers)
                    row["kernels_per_layer"] = prof["kernels_per_layer"]
                    row["replay_device_ms"] = prof["device_ms"]
                    for name, other in baselines.items():
                        for p in other["profiles"]:
                            if p["batch"] == batch:
                                row[f"{name}_kernels_per_layer"] = p["kernels_per_layer"]
                    RESULTS.setdefault("replay_profiles", []).append(prof)
                    print(f"graph replay, batch {batch}: {prof['kernels']} kernels "
                          f"({prof['kernels_per_layer']:.1f} per layer), {prof['device_ms']:.2f} ms of device "
                          f"time\n{prof['table']}", flush=True)
                    print(f"exposed under PDL, batch {batch}: {sum(prof['exposed_us'].values()) / 1e3:.3f} ms of "
                          f"kernels, {prof['idle_us'] / 1e3:.3f} ms idle\n"
                          f"{per_layer_table(prof, layers, key='exposed_us')}", flush=True)
            with eager(worker):
                row["eager_ms"] = timed(partial(worker.execute, plan), args.device, max(3, args.iters // 5)) * 1e3
        best = row.get("graph_ms", row["eager_ms"])
        row["floor_fraction"] = row["floor_ms"] / best
        rows.append(row)
        log(f"decode batch {batch}: {json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})}")
    RESULTS["decode"] = rows
    for batch in args.eager_profile_batches:
        prof = profile_eager_step(worker, decode_chunks(batch, args.context, bs), args.device)
        RESULTS.setdefault("profiles", []).append(prof)
        print(prof, flush=True)
    # `no_pdl`'s profile is the one whose kernel times add up: under PDL a kernel starts early and
    # its time includes its wait (run 53, batch 1: 2.85 ms of kernel time in a 1.81 ms step).
    for name, other in baselines.items():
        for p in other["profiles"]:
            RESULTS.setdefault("baseline_profiles", []).append({**p, "build": name})
            if name == "no_pdl":  # where the time goes: kernel times that add up
                print(f"no_pdl profile, batch {p['batch']}: {p['device_ms']:.3f} ms of kernels\n"
                      f"{per_layer_table(p, layers)}", flush=True)
    return llm


# ---- FP8 weights ------------------------------------------------------------------------------

FP8_PROMPT = [5 + (i * 37) % 1000 for i in range(64)]


def prompt_logits(llm: LLM, triton_kernels: bool = True) -> torch.Tensor:
    """fp32 logits [64, vocab] of a fixed 64-token prompt, cache-less eager forward of rank 0's
    model; triton_kernels=False: LATENTSERVE_MOE_KERNELS=0 (torch GEMMs and experts, FP8 weights
    dequantized to bf16 first), the same weights through other kernels."""
    worker = llm.executor.rank0
    meta = AttnMetadata.build([SeqChunk(0, FP8_PROMPT, 0, [])], llm.config.block_size, worker.device)
    with switches({"LATENTSERVE_MOE_KERNELS": "1" if triton_kernels else "0"}), torch.inference_mode():
        hidden = worker.model(torch.tensor(FP8_PROMPT, device=worker.device), meta, None)
        return worker.model.compute_logits(hidden).float()


def reference_logits(llm: LLM) -> dict:
    """The bf16 model's prompt logits through the Triton kernels and through torch's."""
    return {"triton": prompt_logits(llm), "torch": prompt_logits(llm, triton_kernels=False)}


def compare_logits(ours: torch.Tensor, ref: torch.Tensor) -> dict:
    return {"max_err": (ours - ref).abs().max().item(), "max_abs": ref.abs().max().item(),
            "argmax_agree": (ours.argmax(-1) == ref.argmax(-1)).float().mean().item(),
            "corr": torch.corrcoef(torch.stack([ours.flatten(), ref.flatten()]))[0, 1].item()}


def bench_fp8(args, bw: float, ref_logits: dict | None) -> None:
    """The same model with FP8 128x128 block-scaled weights (--quantization fp8 of the bf16
    build's draw): decode graph ms per batch against its own floor (FP8 bytes read), and the
    logits against the bf16 build's (quantization), against the same FP8 weights through torch
    (kernels), next to the bf16 build's Triton vs torch logits: the noise floor. A random
    24-layer routed model amplifies rounding-sized differences (top-k choices flip), so only a
    kernel error well above that floor means a kernel is wrong."""
    baselines = {name: isolated(f"fp8 baseline {name}", partial(mode_graph_ms, args, env, quantization="fp8"),
                                ms={}, profiles=[])
                 for name, env in FP8_BASELINES.items() if name in args.fp8_baselines}
    llm = decode_llm(args, quantization="fp8")
    worker, rows = llm.executor.rank0, []
    for batch in args.batches:
        chunks = decode_chunks(batch, args.context, llm.config.block_size)
        floor = step_floor_bytes(worker, chunks)
        need = step_bytes(floor)
        plan = StepPlan(chunks)
        with torch.inference_mode():
            worker.execute(plan)
            ms = timed(partial(worker.execute, plan), args.device, args.iters) * 1e3
        rows.append({"batch": batch, "bytes": need, "floor_ms": need / bw * 1e3, "graph_ms": ms,
                     "floor_fraction": need / bw * 1e3 / ms, **floor})
        for name, other in baselines.items():  # the baseline's step over this one's, same run
            rows[-1][f"{name}_graph_ms"] = other["ms"].get(batch, float("nan"))
            rows[-1][f"{name}_ratio"] = rows[-1][f"{name}_graph_ms"] / ms
        if batch in args.profile_batches and worker.decode_graphs is not None:
            prof = profile_replay(worker.decode_graphs, batch, len(worker.model.layers))
            rows[-1]["kernels_per_layer"] = prof["kernels_per_layer"]
            print(f"FP8 graph replay, batch {batch}: {prof['kernels']} kernels "
                  f"({prof['kernels_per_layer']:.1f} per layer), {prof['device_ms']:.2f} ms of device time\n{prof['table']}")
        log(f"fp8 decode batch {batch}: {json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()})}")
    out = {"decode": rows, "graphs": worker.decode_graphs.stats() if worker.decode_graphs else "off",
           "baselines": baselines}
    if ref_logits is not None:
        ours = prompt_logits(llm)
        out["logits"] = {"fp8_vs_bf16": compare_logits(ours, ref_logits["triton"]),
                         "fp8_triton_vs_torch": compare_logits(ours, prompt_logits(llm, triton_kernels=False)),
                         "bf16_triton_vs_torch": compare_logits(ref_logits["torch"], ref_logits["triton"])}
    RESULTS["fp8"] = out
    llm.shutdown()
    torch.cuda.empty_cache()


# ---- prefill vs the matmul rate ------------------------------------------------------------------

def matmul_rate(device: str, n: int, repeat: int = 7) -> float:
    """bf16 FLOP/s of one large torch.matmul (n x n x n), median of `repeat` timings of 5 calls."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    fn = partial(torch.matmul, a, b)
    timed(fn, device, 3)  # warm-up: cuBLAS handle and heuristics
    return 2 * n ** 3 / statistics.median(timed(fn, device, 5) for _ in range(repeat))


def kernel_kind(name: str) -> str:
    """What a prefill kernel does, from its name: matmuls, attention, the MoE's expert kernels
    (Triton's by their names), routing (top-k), the rest."""
    s = name.lower()
    if any(k in s for k in ("flash", "fmha", "attention", "attn")):
        return "attention"
    if any(k in s for k in ("moe", "grouped", "expert", "_gate_up_kernel", "_down_kernel", "_align_kernel",
                            "_slot_sum_kernel", "_entry_kernel")):
        return "moe"
    if any(k in s for k in ("topk", "route", "router", "sort")):
        return "routing"
    if any(k in s for k in ("gemm", "gemv", "matmul", "xmma", "cutlass", "sm90_", "cublas")):
        return "gemm"
    return "other"


def profile_prefill(worker, plan, device: str, top: int = 15) -> dict:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        worker.execute(plan)
        sync(device)
    kinds: dict[str, float] = {}
    events = [e for e in prof.events() if e.device_type.name == "CUDA"]
    for e in events:
        kind = kernel_kind(e.name)
        kinds[kind] = kinds.get(kind, 0.0) + e.time_range.elapsed_us() / 1e3
    table = prof.key_averages().table(sort_by="device_time_total", row_limit=top, max_name_column_width=70)
    return {"kernels": len(events), "device_ms": sum(kinds.values()), "ms_by_kind": kinds, "table": table}


# Prefill's kernel choices above the decode sizes, each timed against the default in the same run.
PREFILL_VARIANTS = {
    "eager_prefill": {"LATENTSERVE_PREFILL_GRAPHS": "0"},  # default: piecewise graphs (model/prefill_graphs.py)
    "torch_grouped_moe": {"LATENTSERVE_MOE_GROUPED_MAX_TOKENS": "1024"},  # default: the Triton kernels at every size
    "triton_router": {"LATENTSERVE_ROUTE_MAX_TOKENS": "1000000000"},  # default: cuBLAS logits + the select kernel
    "torch_topk": {"LATENTSERVE_ROUTE_SELECT": "0"},  # cuBLAS logits + the torch chain (three top-k's)
    # default: flash with v padded until a shape has done enough work to earn a cuDNN plan (model/sdpa.py)
    "padded_v": {"LATENTSERVE_SDPA_CUDNN": "never"},
}


def bench_prefill(args) -> None:
    """One prefill step of --prefill-seqs x --prefill-len tokens from position 0 (the engine's
    prefill path: piecewise graphs with eager attention, `eager_prefill` its baseline): FLOPs counted
    from the config (bench/prefill_flops.py) over the step's time, against a large bf16 matmul
    timed in the same run (issue 12's target: >= 0.40)."""
    from prefill_flops import prefill_flops

    from service.model import sdpa

    cuda = args.device.startswith("cuda")
    seqs, length = args.prefill_seqs, args.prefill_len
    # No decode graphs (nothing here decodes); the prefill graphs are captured for up to the step's tokens.
    llm = make_llm(args.device, MID, args.preset, max_num_seqs=seqs, max_num_batched_tokens=seqs * length,
                   max_model_len=max(length + 1, 256), kv_cache_memory_bytes=GIB, cuda_graph_batch_sizes=[])
    worker, cfg = llm.executor.rank0, llm.config.model_config
    graphs = worker.prefill_graphs.stats() if worker.prefill_graphs is not None else None
    log(f"prefill graphs: {graphs}")
    per = -(-length // llm.config.block_size)
    plan = StepPlan([SeqChunk(i, [5 + (31 * i + 7 * j) % (cfg.vocab_size - 5) for j in range(length)], 0,
                              list(range(i * per, (i + 1) * per)), state_slot=i) for i in range(seqs)])
    flops = prefill_flops(cfg, [length] * seqs)
    total = sum(flops.values())
    with torch.inference_mode():
        # Warm-up to the steady state of a repeated step: its attention shape earns a cuDNN plan
        # after sdpa.PLAN_AFTER of work on flash (model/sdpa.py); `padded_v` below stays on flash.
        def planned() -> bool:
            return any(s[0] == seqs and s[2] == length and w >= sdpa.PLAN_AFTER for s, w in sdpa.PLANS.work.items())

        steps = 0
        while steps < 64 and cuda and not planned():
            timed(partial(worker.execute, plan), args.device, 1)
            steps += 1
        timed(partial(worker.execute, plan), args.device, 2)
        log(f"prefill warm-up: {steps + 2} steps; the step's shape has a cuDNN plan: {planned()}")
        runs = [timed(partial(worker.execute, plan), args.device, 3) * 1e3 for _ in range(5)]
        ms, best = statistics.median(runs), min(runs)
        prof = profile_prefill(worker, plan, args.device)
        # In-run baselines: the same step under each switch (read per step, graphs or not).
        variants = {}
        for name, env in {**PREFILL_VARIANTS, **dict(args.prefill_variant)}.items():
            with switches(env):
                timed(partial(worker.execute, plan), args.device, 1)
                variants[name] = statistics.median(
                    timed(partial(worker.execute, plan), args.device, 3) for _ in range(3)) * 1e3
            log(f"prefill with {env}: {variants[name]:.2f} ms = {variants[name] / ms:.2f}x the default's {ms:.2f} ms")
    llm.shutdown()
    n = 8192 if cuda else 512
    rate = matmul_rate(args.device, n)
    achieved = total / (ms / 1e3)
    # Eager, the step was ~1100 launches from Python and host jitter moved its wall time by up to
    # 1.5x between runs of the same code (runs 14-16). The best of the runs and the profile's
    # device time bound it from the host side and the device side.
    res = {"seqs": seqs, "len": length, "layers": cfg.num_hidden_layers, "step_ms": ms, "best_ms": best,
           "prefill_graphs": graphs,
           "flops": total, "flops_by_part": flops, "achieved_tflops": achieved / 1e12, "matmul_n": n,
           "matmul_tflops": rate / 1e12, "ratio": achieved / rate, "best_ratio": total / (best / 1e3) / rate,
           "device_ratio": total / (prof["device_ms"] / 1e3) / rate if prof["device_ms"] else None, "profile_kernels": prof["kernels"], "profile_device_ms": prof["device_ms"],
           "profile_ms_by_kind": prof["ms_by_kind"], "variants_ms": variants}
    RESULTS["prefill"] = res
    print(f"prefill step {seqs} x {length}: {prof['kernels']} GPU kernels/copies, {prof['device_ms']:.2f} ms of "
          f"device time; by kind (ms): { {k: round(v, 2) for k, v in prof['ms_by_kind'].items()} }\n{prof['table']}",
          flush=True)
    log(f"prefill: { {k: round(v, 4) if isinstance(v, float) else v for k, v in res.items()} }")


def print_prefill() -> None:
    p = RESULTS.get("prefill")
    if not p:
        return
    mode = "piecewise graphs" if p.get("prefill_graphs") else "eager"
    print(f"prefill {p['seqs']} x {p['len']} tokens ({p['layers']} layers, {mode}): {p['step_ms']:.1f} ms, "
          f"{p['flops'] / 1e12:.2f} TFLOP -> {p['achieved_tflops']:.0f} TFLOP/s; bf16 matmul {p['matmul_n']}^3: "
          f"{p['matmul_tflops']:.0f} TFLOP/s; achieved / matmul = {p['ratio']:.3f} (target >= 0.40); best of "
          f"the runs {p['best_ms']:.1f} ms ({p['best_ratio']:.3f}); device time alone {p['profile_device_ms']:.1f} ms "
          f"({p['device_ratio'] or 0:.3f})")
    print("  TFLOP by part: " + ", ".join(f"{k} {v / 1e12:.2f}" for k, v in p["flops_by_part"].items()))
    print(f"  device time by kernel kind (ms, of {p['profile_device_ms']:.1f}): "
          + ", ".join(f"{k} {v:.1f}" for k, v in sorted(p["profile_ms_by_kind"].items(), key=lambda kv: -kv[1])))


# ---- throughput vs transformers ----------------------------------------------------------------

@torch.no_grad()
def to_transformers(model, device: str):
    """transformers' DeepseekV3ForCausalLM holding our model's weights (same checkpoint)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = model.config
    d = {k: v for k, v in cfg.to_dict().items() if k not in ("architectures", "model_type", "moe_latent_size",
                                                               "latent_moe_use_norm", "torch_dtype")}
    d["num_nextn_predict_layers"] = 0
    hf_cfg = DeepseekV3Config(**d)
    with torch.device(device):
        hf = DeepseekV3ForCausalLM._from_config(hf_cfg, dtype=model.dtype)
    hf.eval()
    ours = dict(model.named_parameters())
    specs = {s.hf_name: s for s in weights.weight_specs(cfg) if s.param != s.hf_name and s.expert is None}
    for name, t in list(hf.named_parameters()) + list(hf.named_buffers()):
        if name.endswith(".experts.gate_up_proj"):
            pre = name.removesuffix("gate_up_proj")
            t.copy_(ours[pre + "w13"])  # gate rows then up rows, as transformers stacks them
        elif name.endswith(".experts.down_proj"):
            t.copy_(ours[name.removesuffix("down_proj") + "w2"])
        elif name in specs:  # a part of one of our fused parameters (gate_up_proj, fused_qkv_a_proj)
            t.copy_(specs[name].target(ours[specs[name].param]))
        elif name in ours:
            t.copy_(ours[name])
        elif not name.endswith("inv_freq"):
            raise KeyError(f"transformers weight {name} has no counterpart in our model")
    return hf


@torch.inference_mode()
def first_token_margins(llm, hf, prompts, device: str) -> dict:
    """Where the engines' first greedy tokens differ, was it a near-tie? Our top-2 logprob margin
    per prompt next to the logprob gap between the engines on the token we chose."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, logprobs=2)
    outs = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    ref = torch.log_softmax(hf(input_ids=torch.tensor(prompts, device=device)).logits[:, -1].float(), -1)
    agree, gaps, margins, split = 0, [], [], []
    for o, lp in zip(outs, ref):
        tok, ours_lp = o.token_ids[0], o.logprobs[0]
        top = sorted(ours_lp.values(), reverse=True)
        margin = top[0] - top[1]
        gaps.append(abs(ours_lp[tok] - float(lp[tok])))
        margins.append(margin)
        if tok == int(lp.argmax()):
            agree += 1
        else:
            split.append(round(margin, 4))
    return {"agree": agree / len(prompts), "max_logprob_gap": max(gaps),
            "median_margin": statistics.median(margins), "margins_where_split": split}


def bench_vs_transformers(args) -> None:
    from decode_bench import bench_prompts, measure_decode

    llm = make_llm(args.device, PLAIN, args.preset, max_num_seqs=64)
    cfg = llm.config.model_config
    prompts = bench_prompts(args.hf_batch, args.prompt_len, cfg.vocab_size)

    def ours(ps, n):
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params)]

    hf = to_transformers(llm.executor.rank0.model, args.device)
    impl = getattr(hf.config, "_experts_implementation", None)

    @torch.inference_mode()
    def theirs(ps, n):
        ids = torch.tensor(ps, device=args.device)
        out = hf.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                          do_sample=False, pad_token_id=0)
        return out[:, ids.shape[1]:].tolist()

    ours(prompts[:2], 4)
    theirs(prompts[:2], 4)
    # bf16 rounding differs between the engines: near-ties may flip, a wrong mapping flips everything.
    same = sum(a == b for a, b in zip(ours(prompts, 8), theirs(prompts, 8))) / len(prompts)
    first = first_token_margins(llm, hf, prompts, args.device)
    log(f"first token vs transformers: {first}")
    row_ours = measure_decode(ours, prompts, args.tokens, args.repeats)
    row_hf = measure_decode(theirs, prompts, args.hf_tokens, 1)
    RESULTS["vs_transformers"] = {"ours": row_ours, "transformers": row_hf, "experts_implementation": impl,
                                  "same_first_8_tokens": same, "first_token": first,
                                  "speedup": row_ours["decode_tokens_per_s"] / row_hf["decode_tokens_per_s"]}
    log(f"vs transformers: {RESULTS['vs_transformers']}")
    llm.shutdown()


# ---- sleep ---------------------------------------------------------------------------------------

def bench_sleep(llm: LLM, args) -> None:
    from sleep import reference_copy

    l1 = []
    for _ in range(args.sleep_cycles):
        s, w = llm.sleep(1)[0], llm.wake_up()[0]
        l1.append({"offload_gbps": s["bytes_backed_up"] / s["seconds"] / 1e9,
                   "restore_gbps": w["bytes_restored"] / w["seconds"] / 1e9, "bytes": s["bytes_backed_up"],
                   "sleep_s": s["seconds"], "wake_s": w["seconds"]})
        log(f"level 1: {l1[-1]}")
    nbytes = l1[0]["bytes"]
    out_s, in_s = reference_copy(nbytes, torch.device(args.device), 3)
    rest = l1[1:] or l1
    res = {"cycles": l1, "ref_out_gbps": nbytes / out_s / 1e9, "ref_in_gbps": nbytes / in_s / 1e9,
           "offload_gbps": statistics.median(r["offload_gbps"] for r in rest),
           "restore_gbps": statistics.median(r["restore_gbps"] for r in rest)}
    res["offload_ratio"] = res["offload_gbps"] / res["ref_out_gbps"]
    res["restore_ratio"] = res["restore_gbps"] / res["ref_in_gbps"]
    s = llm.sleep(2)[0]
    w = llm.wake_up(["weights"])[0]
    llm.wake_up(["kv_cache"])
    res["level2_sleep_s"] = s["seconds"]
    res["level2_weights_mapped"] = w["bytes_mapped"]
    res["level2_wake_ms_per_gib"] = w["seconds"] * 1e3 / (w["bytes_mapped"] / GIB)
    RESULTS["sleep"] = res
    log(f"sleep: { {k: v for k, v in res.items() if k != 'cycles'} }")


def bench_tail_section(args) -> None:
    if not os.path.exists(os.path.join(ROOT, "service", "tail", "triton_tail.py")):
        RESULTS["tail"] = "skipped: service/tail/triton_tail.py absent"
        return
    from tail import bench_cuda

    ns = argparse.Namespace(tp=[2], m=[1, 4, 8, 16, 32, 64], hidden=2048, latent=1024, dtype="bf16", scale=0.3)
    bench_cuda(ns)
    RESULTS["tail"] = "printed above (bench/tail.py --device cuda --tp 2)"


# ---- table ---------------------------------------------------------------------------------------

def print_table(args, bw: float) -> None:
    print()
    print(f"GPU serving bench, {RESULTS['device']}, torch {torch.__version__}, commit {args.commit}, "
          f"{time.strftime('%Y-%m-%d')}")
    print(f"device copy bandwidth (read + write): {bw / 1e12:.2f} TB/s")
    stats = RESULTS.get("graph_stats")
    compiled = stats.get("compiled_layers") if isinstance(stats, dict) else "graphs off"
    up = {k: round(v, 1) for k, v in RESULTS.get("engine_up_s", {}).items()}
    print(f"decode graphs: compiled layers {compiled}; engine up (s) by build: {up}")
    print(f"{'decode (ctx ' + str(args.context) + ')':16s} {'floor ms':>9s} {'graph ms':>9s} {'replay ms':>10s} "
          f"{'eager ms':>9s} {'floor/step':>11s} {'GB read':>8s} {'chains ms':>10s} {'vs chains':>10s} "
          f"{'no-compile ms':>14s} {'vs none':>8s} {'torch-MoE ms':>13s} {'vs torch-MoE':>13s} {'k/layer':>8s} "
          f"{'chains k/l':>11s} {'none k/l':>9s} {'torch-MoE k/l':>14s}")
    nan = float("nan")
    for r in RESULTS.get("decode", []):
        g = r.get("graph_ms", nan)
        print(f"{'batch ' + str(r['batch']):16s} {r['floor_ms']:9.3f} {g:9.3f} "
              f"{r.get('replay_ms', nan):10.3f} {r['eager_ms']:9.3f} {r['floor_fraction']:11.3f} "
              f"{r['bytes'] / 1e9:8.2f} {r.get('chains_graph_ms', nan):10.3f} {r.get('chains_graph_ms', nan) / g:10.2f} "
              f"{r.get('uncompiled_graph_ms', nan):14.3f} {r.get('uncompiled_graph_ms', nan) / g:8.2f} "
              f"{r.get('torch_moe_graph_ms', nan):13.3f} {r.get('torch_moe_graph_ms', nan) / g:13.2f} "
              f"{r.get('kernels_per_layer', nan):8.1f} {r.get('chains_kernels_per_layer', nan):11.1f} "
              f"{r.get('uncompiled_kernels_per_layer', nan):9.1f} {r.get('torch_moe_kernels_per_layer', nan):14.1f}")
    for name in [n for n in RESULTS.get("baselines", {}) if n not in ("uncompiled", "chains", "torch_moe")]:
        cells = [f"batch {r['batch']} {r.get(name + '_graph_ms', nan):.3f} ms = "
                 f"{r.get(name + '_graph_ms', nan) / r.get('graph_ms', nan):.2f}x the default's, "
                 f"{r.get(name + '_kernels_per_layer', nan):.1f} k/layer" for r in RESULTS.get("decode", [])]
        print(f"baseline {name} {BASELINES[name]}: " + "; ".join(cells))
    v = RESULTS.get("vs_transformers")
    if v:
        print(f"batch {args.hf_batch} decode tok/s: ours {v['ours']['decode_tokens_per_s']:.0f}, transformers "
              f"{v['transformers']['decode_tokens_per_s']:.0f} (experts: {v['experts_implementation']}) -> "
              f"{v['speedup']:.1f}x; prompts whose first 8 greedy tokens agree: {v['same_first_8_tokens']:.0%}")
        f = v["first_token"]
        print(f"first token: {f['agree']:.0%} agree; our top-2 margin median {f['median_margin']:.4f}, where they "
              f"split {f['margins_where_split']}; max logprob gap on our token {f['max_logprob_gap']:.4f}")
    s = RESULTS.get("sleep")
    if s:
        print(f"level 1 offload {s['offload_gbps']:.1f} GB/s / pinned {s['ref_out_gbps']:.1f} = {s['offload_ratio']:.2f}; "
              f"restore {s['restore_gbps']:.1f} / {s['ref_in_gbps']:.1f} = {s['restore_ratio']:.2f}")
        print(f"level 2 weights wake: {s['level2_wake_ms_per_gib']:.2f} ms/GiB "
              f"({s['level2_weights_mapped'] / GIB:.2f} GiB mapped)")
    f8 = RESULTS.get("fp8")
    if f8:
        bf16 = {r["batch"]: r.get("graph_ms", nan) for r in RESULTS.get("decode", [])}
        print(f"FP8 weights (128x128 blocks; Triton FP8 GEMV / W8A16 / W8A8 by rows), decode graphs (ctx {args.context})")
        for name, c in f8.get("logits", {}).items():  # bf16_triton_vs_torch: what rounding alone moves
            print(f"  logits {name}: max error {c['max_err']:.4f} (max |logit| {c['max_abs']:.3f}), "
                  f"argmax agree {c['argmax_agree']:.1%} of 64 positions, correlation {c['corr']:.4f}")
        for r in f8["decode"]:
            b = bf16.get(r["batch"], nan)
            print(f"  batch {r['batch']:4d}: FP8 floor {r['floor_ms']:.3f} ms, graph {r['graph_ms']:.3f} ms, "
                  f"floor/step {r['floor_fraction']:.3f}, {r['bytes'] / 1e9:.2f} GB read; bf16 graph {b:.3f} ms "
                  f"-> FP8 {b / r['graph_ms']:.2f}x")
            for name in f8.get("baselines", {}):
                print(f"    baseline {name} {FP8_BASELINES[name]}: {r.get(name + '_graph_ms', nan):.3f} ms "
                      f"({r.get(name + '_ratio', nan):.2f}x this build's)")
    k3 = RESULTS.get("k3")
    if k3:
        print(f"Kimi-K3 shapes, {K3_BENCH['num_hidden_layers']} layers (6 KDA + 2 MLA), "
              f"{K3_BENCH['n_routed_experts']} experts, eager decode (ctx {args.context}):")
        for r in k3["decode"]:
            print(f"  batch {r['batch']:4d}: floor {r['floor_ms']:.3f} ms, eager {r['eager_ms']:.3f} ms, "
                  f"floor/step {r['floor_fraction']:.3f}, {r['bytes'] / 1e9:.2f} GB read")
    k3g = RESULTS.get("k3graphs") or {}
    for name, res in k3g.items():
        if name == "overrides" or "decode" not in res:
            continue
        stats = res["graphs"]
        compiled = stats.get("compiled_layers") if isinstance(stats, dict) else stats
        print(f"Kimi-K3 structure at small widths (K3_SMALL: 24 layers, 18 KDA + 6 MLA), {name} {res['env']}, "
              f"ctx {args.context}, graphs vs eager; compiled layers {compiled}:")
        for r in res["decode"]:
            over = "".join(f", {k} {v:.3f}x" for k, v in r.items() if k.startswith("over_"))
            print(f"  batch {r['batch']:4d}: floor {r['floor_ms']:.3f} ms, graph {r['graph_ms']:.3f} ms, eager "
                  f"{r['eager_ms']:.3f} ms, speedup {r['speedup']:.2f}x, floor/step {r['floor_fraction']:.3f}{over}")
    print_prefill()
    for name, err in RESULTS.get("errors", {}).items():
        print(f"section {name} FAILED: {err.strip().splitlines()[-1]}")


def section(name: str, fn, *args):
    """Run one section; a failure is recorded and the other sections still run."""
    try:
        return fn(*args)
    except Exception:
        RESULTS.setdefault("errors", {})[name] = traceback.format_exc()
        log(f"section {name} failed:\n{RESULTS['errors'][name]}")
        return None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--commit", default="unknown")
    ap.add_argument("--batches", default="1,8,64,256", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--profile-batches", default="1,8,64,256", type=lambda s: [int(x) for x in s.split(",") if x],
                    help="graph replays profiled (kernels per layer), in every compile mode")
    ap.add_argument("--eager-profile-batches", default="", type=lambda s: [int(x) for x in s.split(",") if x],
                    help="eager steps profiled (the compiled layers are not used there)")
    ap.add_argument("--k3-configs", default="none", type=lambda s: [x for x in s.split(",") if x],
                    help=f"k3graphs: comma list of {','.join(K3_CONFIGS)}, the first the others' baseline")
    ap.add_argument("--baselines", default=",".join(BASELINES), type=lambda s: [x for x in s.split(",") if x],
                    help="in-run baselines of the decode section (names in BASELINES)")
    ap.add_argument("--fp8-baselines", default=",".join(FP8_BASELINES),
                    type=lambda s: [x for x in s.split(",") if x], help="in-run baselines of the FP8 section")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--kv-gib", type=int, default=8, help="KV cache; batch 256 at context 1024 needs 7.4 GB")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--hf-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--sleep-cycles", type=int, default=3)
    ap.add_argument("--prefill-seqs", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--prefill-variant", action="append", default=[],
                    type=lambda s: (s.split("=", 1)[0], json.loads(s.split("=", 1)[1])),
                    help='one more prefill variant, NAME={"LATENTSERVE_...": "..."} (repeatable)')
    ap.add_argument("--skip", default="", help="comma list of sections to skip: decode,hf,sleep,fp8,k3,k3graphs,prefill,tail")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    skip = set(filter(None, args.skip.split(",")))
    # The worker looks it up in service.weights.checkpoint at call time.
    weights.checkpoint.init_dummy_weights = weights.init_dummy_weights = device_dummy_init
    cuda = args.device.startswith("cuda")
    RESULTS["device"] = torch.cuda.get_device_name() if cuda else "cpu"
    bw = copy_bandwidth(args.device, 4 * GIB if cuda else GIB // 4)
    RESULTS["copy_bw"] = bw
    log(f"copy bandwidth {bw / 1e9:.0f} GB/s")
    llm = None
    if "decode" not in skip or "sleep" not in skip:
        llm = section("decode", bench_decode, args, bw) if "decode" not in skip else make_llm(
            args.device, MID, args.preset, enable_sleep_mode=True)
    ref_logits = section("fp8_ref", reference_logits, llm) if llm is not None and "fp8" not in skip else None
    if "hf" not in skip:
        section("hf", bench_vs_transformers, args)
    if llm is not None and "sleep" not in skip:
        section("sleep", bench_sleep, llm, args)
    if llm is not None:
        llm.shutdown()
    if "fp8" not in skip:
        section("fp8", bench_fp8, args, bw, ref_logits)
    if "k3" not in skip:
        section("k3", bench_k3, args, bw)
    if "k3graphs" not in skip:
        section("k3graphs", bench_k3_graphs, args, bw)
    if "prefill" not in skip:
        section("prefill", bench_prefill, args)
    print_table(args, bw)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(RESULTS, f, indent=1, default=str)
    if cuda and "tail" not in skip:  # last: it prints its own table
        section("tail", bench_tail_section, args)


if __name__ == "__main__":
    main()
