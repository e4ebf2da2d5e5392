"""The paged MLA decode kernel (service/model/mla_decode.py) on one GPU: achieved bandwidth over
the copy bandwidth measured in the same run, for the default launch and, with --sweep, every
launch shape (splits, BLOCK_N, warps, stages), and the torch path (gather + two bmm's) as the
baseline.

    python bench/mla_decode.py [--batches 1 8 64 256] [--context 1024] [--sweep [--prefetch] [--tma]]
                               [--write-kv] [--in-order] [--block-size 16] [--cuda] [--json out.json]

Shapes are the `small` preset's (16 heads, kv_lora_rank 512, rope 64, block size 16 unless
--block-size). LATENTSERVE_MLA_TMA=1 times the default launch on TMA tiles (blocks of 32 or 64). Each
measurement is a CUDA graph of back-to-back calls cycling through enough KV caches that they
never sit in L2, as a decode step's 24 layers read 24 different caches.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

from gemv import L2_SAFE, graph_seconds, sweep  # noqa: E402
from gpu import copy_bandwidth, switches  # noqa: E402

from service.model import mla_cuda, mla_decode  # noqa: E402

HEADS, LAT, PE, BLOCK = 16, 512, 64, 16


def case(batch: int, context: int, write_kv: bool = False, shuffled: bool = True,
         block: int = BLOCK) -> tuple[list, int]:
    """Variants of (q, cache, block tables, context lens, new rows, their slots), each cache in
    shuffled blocks (a long-running server's) or in order (a fresh engine's, as bench/gpu.py's
    decode step). write_kv: each sequence's last position arrives as the step's new token, which
    the kernel writes and attends from registers, as the engine's decode step does."""
    blocks = batch * -(-context // block)
    nbytes = blocks * block * (LAT + PE) * 2
    out = []
    for _ in range(max(2, min(24, -(-L2_SAFE // nbytes)))):
        cache = torch.randn(blocks, block, LAT + PE, device="cuda").to(torch.bfloat16)
        order = torch.randperm(blocks, device="cuda") if shuffled else torch.arange(blocks, device="cuda")
        tables = order.view(batch, -1).to(torch.int32)
        q = torch.randn(batch, HEADS, LAT + PE, device="cuda").to(torch.bfloat16)
        lens = torch.full((batch,), context, device="cuda", dtype=torch.int64)
        new_kv = new_slots = None
        if write_kv:
            last = context - 1
            new_kv = torch.randn(batch, LAT + PE, device="cuda").to(torch.bfloat16)
            new_slots = tables[:, last // block].long() * block + last % block
        out.append((q, cache, tables, lens, new_kv, new_slots))
    return out, nbytes


def run(v, splits=None, cfg=None):
    q, cache, tables, lens, new_kv, new_slots = v
    new = {} if new_kv is None else {"new_kv": new_kv, "new_slots": new_slots}
    return mla_decode._mla_decode(q, cache, tables, lens, LAT, 0.07, splits=splits, cfg=cfg, **new)


def torch_path(v):
    q, cache, tables, lens = v[:4]
    ctx = cache[tables.long()].view(q.shape[0], -1, LAT + PE)
    p = torch.bmm(q, ctx.transpose(1, 2)).mul_(0.07).softmax(-1)
    return torch.bmm(p, ctx[..., :LAT])


def cuda_kernel(variants, ref, t_default: float) -> dict:
    """The CUDA C split kernel on the same caches (its block tables int64), at any batch (the
    engine runs it up to LATENTSERVE_MLA_CUDA_MAX_ROWS), its time against the default's (the
    Triton kernel: the variants' int32 tables keep the CUDA one out) and its largest difference
    from the one-split Triton result."""
    wide = [(q, cache, tables.long(), *rest) for q, cache, tables, *rest in variants]
    with switches({"LATENTSERVE_MLA_CUDA_MAX_ROWS": str(variants[0][0].shape[0])}):
        err = (run(wide[0]) - ref).abs().max().item()
        t = graph_seconds(run, wide)
    return {"cuda_us": t * 1e6, "cuda_vs_default": t / t_default, "cuda_max_err": err,
            "cuda_off": mla_cuda.GUARD.failure}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--splits", type=int, nargs="+", default=[4, 8, 16, 32, 64], help="split counts the sweep tries")
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2], help="pipeline stages the sweep tries")
    ap.add_argument("--block-n", type=int, nargs="+", default=[32, 64], help="context tile widths the sweep tries")
    ap.add_argument("--warps", type=int, nargs="+", default=[4, 8], help="warp counts the sweep tries")
    ap.add_argument("--prefetch", action="store_true", help="the sweep also tries prefetched block tables (PREFETCH_BT)")
    ap.add_argument("--maxnreg", type=int, nargs="+", default=[0], help="register caps the sweep tries (0: none)")
    ap.add_argument("--write-kv", action="store_true", help="the kernel writes and attends each sequence's new token")
    ap.add_argument("--in-order", action="store_true", help="blocks in order (a fresh engine's), not shuffled")
    ap.add_argument("--block-size", type=int, default=BLOCK, help="KV cache block size (the engine's --block-size)")
    ap.add_argument("--tma", action="store_true", help="the sweep's shapes on TMA tiles (mla_decode_tma.py)")
    ap.add_argument("--cuda", action="store_true",
                    help="also the CUDA C split kernel (mla_cuda.py) at each batch, against the default")
    ap.add_argument("--json")
    args = ap.parse_args()
    bw = copy_bandwidth("cuda")
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)
    rows = []
    for b in args.batches:
        variants, nbytes = case(b, args.context, args.write_kv, not args.in_order, args.block_size)
        ref = run(variants[0], splits=1)
        t_ours = graph_seconds(run, variants)
        t_torch = graph_seconds(torch_path, variants[:2])
        default = {"splits": mla_decode.num_splits(b, HEADS)}
        row = {"batch": b, "context": args.context, "kv_mb": nbytes / 1e6, "ours_us": t_ours * 1e6,
               "torch_us": t_torch * 1e6, "ours_vs_torch": t_torch / t_ours, "ours_of_copy_bw": nbytes / t_ours / bw,
               "default": default}
        if args.cuda:
            row.update(cuda_kernel(variants, ref, t_ours))
        if args.sweep:
            prefetch = (False, True) if args.prefetch else (False,)
            shapes = [{"splits": splits, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages, "PREFETCH_BT": pf,
                       **({"maxnreg": maxnreg} if maxnreg else {}), **({"TMA": True} if args.tma else {})}
                      for splits, bn, warps, stages, pf, maxnreg in itertools.product(
                          args.splits, args.block_n, args.warps, args.stages, prefetch, args.maxnreg)
                      if b * splits <= 8192]

            def launched(v, shape):
                return run(v, shape["splits"], {k: x for k, x in shape.items() if k != "splits"})

            row.update(sweep(lambda s: graph_seconds(lambda v: launched(v, s), variants, reps=2),  # noqa: B023
                             lambda s: (launched(variants[0], s) - ref).abs().max().item(),  # noqa: B023
                             shapes, t_ours, default, nbytes, bw))
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bw": bw, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
