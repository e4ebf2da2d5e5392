"""Micro-benchmark: the Triton grouped-GEMM experts (service/model/moe_grouped.py) against the torch
path they replace (FusedExperts.grouped: argsort, gathers, two torch._grouped_mm, scatter, slot
sum) on the small preset's expert shapes (64 experts, latent width 1024, intermediate 768, top 8,
bf16), one MoE layer, each side captured in a CUDA graph and replayed (as decode runs it):

    python3 bench/moe_grouped.py [--m 64,256] [--sweep]

Prints per M: us per layer of each side, the expert weight bytes the step must read (experts that
got a token) over that time in GB/s and as a fraction of the device copy bandwidth measured here,
the ratio torch / Triton, the align kernel alone, and the relative difference of the outputs.
At prefill sizes (--m 2048,8192: compute-bound, GB/s means little) the ratio says whether
moe_grouped.max_tokens() (above it FusedExperts keeps torch._grouped_mm) is placed right.
--sweep also times candidate block configs (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) per M and
prints the best: copy it into moe_grouped.CONFIGS. Then, at that config's BLOCK_M, the down
kernel's own shapes (LATENTSERVE_MOE_GROUPED_DOWN_CONFIG).
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpu import copy_bandwidth  # noqa: E402

from service.config import PRESETS  # noqa: E402
from service.model import moe_grouped  # noqa: E402
from service.model.moe import FusedExperts  # noqa: E402
from service.parallel import TPGroup  # noqa: E402

KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")


def graph_us(fn, iters: int) -> float:
    """us per call of fn, captured once in a CUDA graph and replayed `iters` times, after as many
    untimed replays: each M's first timing (the table's config) had run ~12% over the same config
    timed again inside the sweep (run 112, H100: 85.4 against 76.0 us at M=8)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(iters):
        g.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def candidates(pairs_per_expert: float) -> list[dict]:
    """Decode (few pairs per expert): ~30 configs of 16-64 rows, 8 warps for the big tiles.
    Prefill (more than 64 pairs per expert, compute-bound): 64-128 rows by 64-128 columns, K steps
    of 64 in 3-4 stages (and 32 for the biggest tile), 8 warps from 128 x 64 on and 4 too at that
    size (~11 configs: each costs two compiles). Configs whose gate/up stages (x tile + gate and up
    tiles, bf16) would not fit the H200's shared memory are left out."""
    out = []
    if pairs_per_expert > 64:
        space = [(bm, bn, 64, st, 8 if bm * bn >= 128 * 64 else 4)
                 for bm, bn, st in itertools.product((64, 128), (64, 128), (3, 4))]
        space += [(128, 64, 64, 4, 4), (128, 128, 32, 4, 8)]
    else:
        space = ((bm, bn, bk, st, 8 if bm * bn >= 64 * 128 else 4)
                 for bm, bn, bk, st in itertools.product((16, 32, 64), (32, 64, 128), (64, 128), (3, 4)))
    for bm, bn, bk, stages, warps in space:
        if (bm * bk + 2 * bk * bn) * 2 * stages <= 200 * 1024:
            out.append(dict(zip(KEYS, (bm, bn, bk, warps, stages))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--m", default="64,256", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    cfg = PRESETS["small"]
    ex = FusedExperts(cfg, cfg.moe_latent_size, TPGroup.single(), torch.bfloat16).cuda()
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0, p.shape[-1] ** -0.5)
    bw = copy_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; copy bandwidth (read + write) "
          f"{bw / 1e12:.2f} TB/s; experts {ex.w13.shape[0]} x (w13 {tuple(ex.w13.shape[1:])}, w2 {tuple(ex.w2.shape[1:])}), "
          f"top {cfg.num_experts_per_tok}, bf16")
    for m in args.m:
        bench_m(ex, m, args, bw)


@torch.inference_mode()
def bench_m(ex: FusedExperts, m: int, args, bw: float) -> None:
    e, width = ex.w13.shape[0], ex.w13.shape[2]
    k = PRESETS["small"].num_experts_per_tok
    g = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, width, device="cuda", dtype=torch.bfloat16, generator=g)
    ids = torch.rand(m, e, device="cuda", generator=g).topk(k, dim=1).indices  # uniform routing
    weights = torch.rand(m, k, device="cuda", generator=g)
    nbytes = int(ids.unique().numel()) * (ex.w13[0].numel() + ex.w2[0].numel()) * ex.w13.element_size()
    ours_fn = partial(torch.ops.latentserve.moe_grouped_experts, x, ex.w13, ex.w2, weights, ids, "silu", 1.0, None)
    torch_fn = partial(ex.grouped, x, weights, ids)
    ref = torch_fn().float()
    diff = ((ours_fn().float() - ref).norm() / ref.norm()).item()
    ours, theirs = graph_us(ours_fn, args.iters), graph_us(torch_fn, args.iters)
    cfg = moe_grouped.config(m, k, e)
    align = graph_us(partial(moe_grouped.align, ids, e, cfg["BLOCK_M"]), args.iters)
    print(f"M={m:4d}: {nbytes / 1e6:.0f} MB of experts; Triton {ours:7.1f} us "
          f"({nbytes / ours / 1e3:6.0f} GB/s, {nbytes / ours * 1e6 / bw:.2f} of copy), torch {theirs:7.1f} us "
          f"({nbytes / theirs / 1e3:6.0f} GB/s, {nbytes / theirs * 1e6 / bw:.2f} of copy); torch / Triton "
          f"{theirs / ours:.2f}x; align kernel {align:.1f} us; config {cfg}; outputs differ by {diff:.1e} "
          f"(relative)", flush=True)
    if not args.sweep:
        return
    results = []
    for c in candidates(m * k / e):
        try:
            us = graph_us(partial(moe_grouped.grouped_experts, x, ex.w13, ex.w2, weights, ids, "silu", 1.0, None,
                                  cfg=c), max(10, args.iters // 4))
        except Exception as err:  # noqa: BLE001 - out of shared memory etc.: skip the config
            print(f"  {tuple(c.values())}: failed ({type(err).__name__})")
            continue
        results.append((us, tuple(c.values())))
    results.sort()
    flops = 2 * m * k * 3 * ex.w2.shape[1] * ex.w2.shape[2]  # gate, up and down per (token, slot) pair
    for us, c in results[:8]:
        print(f"  sweep M={m}: {c} {us:7.1f} us ({nbytes / us * 1e6 / bw:.2f} of copy, "
              f"{flops / us / 1e6:.0f} TFLOP/s, {theirs / us:.2f}x torch, {ours / us:.2f}x the table's)")
    if not results:
        return
    # the LATENTSERVE_MOE_GROUPED_CONFIG spelling of the best, for scripts
    print(f"best M={m}: {','.join(map(str, results[0][1]))} {results[0][0]:.1f} us")
    sweep_down(ex, x, weights, ids, dict(zip(KEYS, results[0][1])), results[0][0], max(10, args.iters // 4))


def down_candidates(block_m: int) -> list[dict]:
    """The down kernel's own shapes at the best gate/up config's BLOCK_M (the alignment's)."""
    out = []
    for bn, bk, st in itertools.product((32, 64, 128), (32, 64, 128), (3, 4)):
        if (block_m * bk + bk * bn) * 2 * st <= 200 * 1024:
            out.append(dict(zip(moe_grouped.DOWN_KEYS, (bn, bk, 8 if block_m * bn >= 64 * 128 else 4, st))))
    return out


def sweep_down(ex: FusedExperts, x, weights, ids, best: dict, best_us: float, iters: int) -> None:
    """With gate/up at its best, the down kernel's shape apart (LATENTSERVE_MOE_GROUPED_DOWN_CONFIG)."""
    m = x.shape[0]
    results = []
    for d in down_candidates(best["BLOCK_M"]):
        try:
            us = graph_us(partial(moe_grouped.grouped_experts, x, ex.w13, ex.w2, weights, ids, "silu", 1.0, None,
                                  cfg={**best, "down": d}), iters)
        except Exception as err:  # noqa: BLE001 - out of shared memory etc.: skip the config
            print(f"  down {tuple(d.values())}: failed ({type(err).__name__})")
            continue
        results.append((us, tuple(d.values())))
    results.sort()
    for us, d in results[:4]:
        print(f"  sweep down M={m}: {d} {us:7.1f} us ({best_us / us:.2f}x the best shared shape's)")
    if results:
        print(f"best down M={m}: {','.join(map(str, results[0][1]))} {results[0][0]:.1f} us "
              f"(shared shape {best_us:.1f} us)")


if __name__ == "__main__":
    main()
