"""The MoE entry kernel (service/model/moe_entry.py: router logits, latent down, shared experts'
gate/up and activation in one launch) on one GPU at decode-sized rows, as achieved bandwidth over
the copy bandwidth measured in the same run, against cuBLAS doing the three projections apart;
with --sweep, every multi-row launch shape (BLOCK_N, BLOCK_K, warps, stages) and the best.

    python bench/moe_entry.py [--rows 1 2 8 16 64] [--sweep] [--json out.json]

Why (bench/RESULTS.md, run 58): without PDL the kernel takes 8.6 us a layer at 8 rows for 10.8
MB, ~2.5 us at copy bandwidth: 116 programs of 16-row tiles, each streaming 64-128 KB in eight
256-wide K steps. Shapes are the `small` preset's: hidden 2048, latent 1024, shared expert 768,
64 experts. Each measurement is a CUDA graph cycling through weight copies that never sit in L2.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from gemv import L2_SAFE, graph_seconds, sweep  # noqa: E402
from gpu import copy_bandwidth  # noqa: E402

from service.model import moe_entry  # noqa: E402

HIDDEN, LATENT, SHARED, EXPERTS = 2048, 1024, 768, 64


def case(rows: int) -> tuple[list, int]:
    """Variants of (x, down, shared gate|up, router), enough weight copies to miss L2."""
    nbytes = (LATENT + 2 * SHARED + EXPERTS) * HIDDEN * 2
    out = []
    for _ in range(max(2, -(-L2_SAFE // nbytes))):
        w = [torch.randn(n, HIDDEN, device="cuda").to(torch.bfloat16) / HIDDEN ** 0.5
             for n in (LATENT, 2 * SHARED, EXPERTS)]
        out.append((torch.randn(rows, HIDDEN, device="cuda").to(torch.bfloat16), *w))
    return out, nbytes


def run(v, cfg=None):
    x, down, shared, router = v
    return moe_entry._entry(x, down, shared, router, "silu", 1.0, None, cfg=cfg)


def cublas(v):
    x, down, shared, router = v
    gate, up = F.linear(x, shared).chunk(2, dim=-1)
    return F.linear(x, down), F.silu(gate) * up, F.linear(x.float(), router.float())


def error(got, want) -> float:
    return max(((g.float() - w.float()).norm() / w.float().norm()).item() for g, w in zip(got, want))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 16, 64])
    ap.add_argument("--sweep", action="store_true", help="multi-row launch shapes (rows >= 2)")
    ap.add_argument("--block-n", type=int, nargs="+", default=[16, 32])
    ap.add_argument("--block-k", type=int, nargs="+", default=[64, 128, 256, 512])
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4])
    ap.add_argument("--json")
    args = ap.parse_args()
    bw = copy_bandwidth("cuda")
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    rows_out = []
    for m in args.rows:
        variants, nbytes = case(m)
        ref = run(variants[0])
        t_ours, t_cublas = graph_seconds(run, variants), graph_seconds(cublas, variants)
        row = {"rows": m, "weights_mb": nbytes / 1e6, "ours_us": t_ours * 1e6, "cublas_us": t_cublas * 1e6,
               "ours_vs_cublas": t_cublas / t_ours, "ours_of_copy_bw": nbytes / t_ours / bw,
               "err_vs_cublas": error(ref, cublas(variants[0]))}
        if args.sweep and m >= 2:
            space = itertools.product(args.block_n, args.block_k, args.warps, args.stages)
            shapes = [{"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
                      for bn, bk, warps, stages in space]
            row.update(sweep(lambda s: graph_seconds(lambda v: run(v, s), variants, reps=2),  # noqa: B023
                             lambda s: error(run(variants[0], s), ref),  # noqa: B023
                             shapes, t_ours, "default", nbytes, bw))
        print(json.dumps(row), flush=True)
        rows_out.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bw": bw, "rows": rows_out}, f, indent=1)


if __name__ == "__main__":
    main()
