"""Decode-sized projections on one GPU: our GEMV (service/model/gemv.py) and the MoE expert
kernels against cuBLAS, as achieved bandwidth over the copy bandwidth measured in the same run.

    python bench/gemv.py [--rows 1 4 8] [--sweep] [--cuda] [--json out.json]

Shapes are the `small` preset's decode projections (bench/gpu.py's model). Each measurement is
a CUDA graph of back-to-back calls, as a decode step replays them, cycling through enough
copies of the weight that it never sits in L2 (the H200's is 50 MB; one decode step reads
2 GB). --sweep times every launch shape of the GEMV (its register product at one row, its
tensor-core tiles from two) and of the expert kernels and prints the best, which is how the
defaults in gemv.config, gemv.dot_config and moe_kernels were chosen. At one row each line also
times the 512-wide K steps used before whole-K slices (`k512_us`), from two rows the register
product the rows ran as before the tensor-core tiles (`product_us`). --cuda also times the CUDA C
GEMV (service/model/gemv_cuda.py) at up to 16 rows on the same weights (`cuda_us`, `cuda_vs_ours`)
and its largest difference from our Triton result (`cuda_max_err`), and with 8 warps on K, the
candidate (`cuda_k8_us`).
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from gpu import copy_bandwidth, switches  # noqa: E402

from service.model import gemv, gemv_cuda, moe_kernels, pdl  # noqa: E402

# (name, N, K) of the small preset: hidden 2048, 16 heads, q_lora 768, kv_lora 512 + rope 64,
# latent 1024, shared expert 768, dense MLP 5632, vocab 32768.
SHAPES = [("fused_qkv_a", 1344, 2048), ("q_b", 3072, 768), ("o_proj", 2048, 2048), ("latent_down", 1024, 2048),
          ("latent_up", 2048, 1024), ("shared_gate_up", 1536, 2048), ("shared_down", 2048, 768),
          ("mlp_gate_up", 11264, 2048), ("mlp_down", 2048, 5632), ("lm_head", 32768, 2048)]
L2_SAFE = 256 << 20


def graph_seconds(fn, variants: list, reps: int = 3) -> float:
    """Seconds per call of fn(v) over the variants (replayed in a graph, best of reps)."""
    calls = [functools.partial(fn, v) for v in variants]
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    best = float("inf")
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / len(calls))
    return best


def sweep(time_of, error_of, shapes: list[dict], default_s: float, default, nbytes: int, bw: float) -> dict:
    """Every launch shape whose output error_of(shape) stays under 1e-2, timed by time_of(shape)
    (seconds); shapes that fail to launch (shared memory) are skipped. -> the best against the
    default launch's time, its share of the copy bandwidth bw, the six fastest."""
    best, tried = (default_s, default), []
    for i, shape in enumerate(shapes):
        try:
            err = error_of(shape)
            t = time_of(shape)
        except Exception:  # noqa: BLE001 - an unlaunchable shape
            continue
        if err < 1e-2:
            tried.append((round(t * 1e6, 2), shape))
            best = min(best, (t, shape), key=lambda b: b[0])
        if i % 12 == 11:
            print(f"  {i + 1} of {len(shapes)} shapes timed", flush=True)
    return {"best_us": best[0] * 1e6, "best": best[1], "best_of_copy_bw": nbytes / best[0] / bw,
            "best_vs_default": default_s / best[0], "fastest": sorted(tried, key=lambda x: x[0])[:6]}


def weights(n: int, k: int, dtype=torch.bfloat16) -> list[torch.Tensor]:
    copies = max(2, -(-L2_SAFE // (n * k * 2)))
    return [torch.randn(n, k, device="cuda").to(dtype) / k ** 0.5 for _ in range(copies)]


def cuda_gemv(x, ws, y, t_ours: float, nbytes: int, bw: float) -> dict:
    """The CUDA C GEMV on the same rows and weights, against our Triton kernel's time and result."""
    with switches({"LATENTSERVE_GEMV_CUDA_MAX_ROWS": str(gemv_cuda.MAX_ROWS)}):
        if not gemv_cuda.supported(x, ws[0]):
            return {"cuda_off": gemv_cuda.GUARD.failure or "unsupported"}
        y2 = torch.empty_like(y)
        t = graph_seconds(lambda w: gemv_cuda.run(x, w, y2), ws)
        gemv_cuda.run(x, ws[0], y2)
        err = (y2.float() - F.linear(x, ws[0]).float()).abs().max().item()
        with switches({"LATENTSERVE_GEMV_CUDA_K_WARPS": "8"}):  # the candidate: 8 warps on K
            t_k8 = graph_seconds(lambda w: gemv_cuda.run(x, w, y2), ws)
    return {"cuda_us": t * 1e6, "cuda_vs_ours": t / t_ours, "cuda_of_copy_bw": nbytes / t / bw, "cuda_max_err": err,
            "cuda_k8_us": t_k8 * 1e6, "cuda_k8_vs_cuda": t_k8 / t, "cuda_off": gemv_cuda.GUARD.failure}


def bench_gemv(rows: list[int], sweep: bool, bw: float, shapes: list[str], cuda: bool = False) -> list[dict]:
    out = []
    sms = gemv.sm_count(torch.device("cuda"))
    for (name, n, k), m in itertools.product([s for s in SHAPES if not shapes or s[0] in shapes], rows):
        ws = weights(n, k)
        x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
        y = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        nbytes = n * k * 2
        t_cublas = graph_seconds(functools.partial(F.linear, x), ws)
        cfg = gemv.shape(m, n, k, sms)
        t_ours = graph_seconds(lambda w: gemv.launch(x, w, y, cfg), ws)  # noqa: B023 - called at once
        row = {"name": name, "m": m, "n": n, "k": k, "cublas_us": t_cublas * 1e6, "ours_us": t_ours * 1e6,
               "ours_vs_cublas": t_cublas / t_ours, "ours_of_copy_bw": nbytes / t_ours / bw, "config": cfg}
        if m == 1:  # 512-wide K steps: the one-row default before whole-K slices (run 39)
            k512 = gemv.config(m, n, k, sms, max_k=512)
            row["k512_us"] = graph_seconds(lambda w: gemv.launch(x, w, y, k512), ws) * 1e6  # noqa: B023
        if cfg.get("DOT") and m <= 64:  # the register product these rows ran as before the tensor-core tiles
            product = gemv.config(m, n, k, sms)
            row["product_us"] = graph_seconds(lambda w: gemv.launch(x, w, y, product), ws) * 1e6  # noqa: B023
        if cuda and m <= gemv_cuda.MAX_ROWS:
            row.update(cuda_gemv(x, ws, y, t_ours, nbytes, bw))
        if sweep:
            best = (t_ours, cfg)
            # One row: the register product's rows and K steps (whole K from 1024 on); more rows:
            # tensor-core tiles (N >= 16, K steps within shared memory).
            for c in sweep_space(m):
                if triton_cdiv(n, c["BLOCK_N"]) * triton_cdiv(m, 64) < sms // 2:  # 64-row blocks above 64
                    continue
                try:
                    t = graph_seconds(lambda w: gemv.launch(x, w, y, c), ws[:8], reps=2)  # noqa: B023
                except Exception:  # noqa: BLE001 - an unlaunchable shape (registers, shared memory)
                    continue
                if t < best[0]:
                    best = (t, c)
            row.update(best_us=best[0] * 1e6, best_config=best[1], best_of_copy_bw=nbytes / best[0] / bw)
        print(json.dumps(row), flush=True)
        out.append(row)
        del ws
    return out


def sweep_space(m: int):
    """Launch shapes of the GEMV: one row's register product (K steps up to whole K) and tensor-core
    tiles from two rows. Split-K shapes (each program a slice of K, the last to arrive adding the
    fp32 partials) were swept in run 40 and never won: bench/RESULTS.md."""
    if m == 1:
        for bn, bk, warps, stages in itertools.product((4, 8, 16), (256, 512, 1024, 2048), (4, 8), (3, 4)):
            if bn * bk <= 32768:
                yield {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
        return
    for bn, bk, warps, stages in itertools.product((16, 32, 64), (64, 128, 256, 512), (4, 8), (3, 4, 5)):
        yield {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages, "DOT": True}


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def bench_experts(rows: list[int], sweep: bool, bw: float) -> list[dict]:
    """moe_kernels' expert kernels at the small preset's experts (64 x latent 1024 x 768, top 8)."""
    e, width, shard, top_k = 64, 1024, 768, 8
    layers = max(2, -(-L2_SAFE // (e * 3 * shard * width * 2)))
    w13s = [torch.randn(e, 2 * shard, width, device="cuda").to(torch.bfloat16) / 32 for _ in range(layers)]
    w2s = [torch.randn(e, width, shard, device="cuda").to(torch.bfloat16) / 28 for _ in range(layers)]
    out = []
    for m in rows:
        x = torch.randn(m, width, device="cuda").to(torch.bfloat16)
        ids = torch.stack([torch.randperm(e, device="cuda")[:top_k] for _ in range(m)])
        wts = torch.rand(m, top_k, device="cuda")
        read = len(ids.unique()) * 3 * shard * width * 2
        layer_ws = list(zip(w13s, w2s))
        ours = functools.partial(experts, x, wts, ids)
        t_ours = graph_seconds(ours, layer_ws)
        t_grouped = graph_seconds(lambda ab: grouped(x, ab[0], ab[1], wts, ids), layer_ws)  # noqa: B023
        row = {"name": "experts", "m": m, "ours_us": t_ours * 1e6, "torch_grouped_us": t_grouped * 1e6,
               "ours_of_copy_bw": read / t_ours / bw, "ours_vs_grouped": t_grouped / t_ours}
        if sweep:
            row.update(sweep_experts(x, w13s, w2s, wts, ids))
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def sweep_experts(x, w13s, w2s, wts, ids) -> dict:
    """Best launch shape of the gate/up and the down kernel alone (SiLU, bf16)."""
    m, width = x.shape
    top_k, shard = ids.shape[1], w2s[0].shape[2]
    pairs = m * top_k
    h = torch.randn(pairs, shard, device="cuda").to(torch.bfloat16)
    part = torch.empty(pairs, width, device="cuda")
    found = {}
    for bn, bk, warps, stages in itertools.product((16, 32, 64), (128, 256, 512), (4, 8), (3, 4)):
        cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}

        def gate_up(a, c=cfg):
            moe_kernels._gate_up_kernel[(pairs, triton_cdiv(shard, c["BLOCK_N"]))](
                x, a, ids, h, width, shard, x.stride(0), a.stride(0), a.stride(1), h.stride(0), 1.0, 1.0,
                TOP_K=top_k, ACT=0, CLIP_UP=False, **c, **pdl.launch(x.device))

        def down(b, c=cfg):
            moe_kernels._down_kernel[(pairs, triton_cdiv(width, c["BLOCK_N"]))](
                h, b, ids, wts, part, width, shard, h.stride(0), b.stride(0), b.stride(1), part.stride(0), **c,
                **pdl.launch(h.device))

        for name, fn, ws, nbytes in (("gate_up", gate_up, w13s, pairs * 2 * shard * width * 2),
                                     ("down", down, w2s, pairs * shard * width * 2)):
            try:
                t = graph_seconds(fn, ws, reps=2)
            except Exception:  # noqa: BLE001 - an unlaunchable shape
                continue
            if t < found.get(name, (float("inf"),))[0]:
                found[name] = (t, cfg, nbytes)
    return {f"best_{k}": {"us": t * 1e6, "config": c, "GBps": b / t / 1e9} for k, (t, c, b) in found.items()}


def experts(x, wts, ids, ab):
    return torch.ops.latentserve.moe_experts(x, ab[0], ab[1], wts, ids, "silu", 1.0, None)


def grouped(x, w13, w2, wts, ids):
    from service.model.moe import FusedExperts

    fe = FusedExperts.__new__(FusedExperts)
    torch.nn.Module.__init__(fe)
    fe.num_experts, fe.shard = w13.shape[0], w2.shape[2]
    fe.act = lambda g, u: F.silu(g) * u
    fe.w13, fe.w2 = w13, w2
    return fe.grouped(x, wts, ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--shapes", nargs="*", default=[], help="names from SHAPES (default all)")
    ap.add_argument("--skip-experts", action="store_true")
    ap.add_argument("--cuda", action="store_true", help="also the CUDA C GEMV (gemv_cuda.py), up to 16 rows")
    ap.add_argument("--json")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gemv.py needs a CUDA GPU")
    bw = copy_bandwidth("cuda")
    print(json.dumps({"copy_bandwidth_TBps": bw / 1e12, "device": torch.cuda.get_device_name()}), flush=True)
    rows = bench_gemv(args.rows, args.sweep, bw, args.shapes, args.cuda)
    if not args.skip_experts:
        rows += bench_experts(args.rows, args.sweep, bw)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bandwidth": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
