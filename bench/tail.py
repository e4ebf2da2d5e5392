"""Fused vs unfused MoE tail latency per call, for decode-sized batches.

CPU (default): real TP rank processes on this machine; the fused tail is ShmTailCollective,
the unfused one is `unfused_tail` over gloo (two all-reduces + the full up-projection).
    python bench/tail.py --tp 2,4,8 --m 1,2,4,8,16,32,64,128

--device cuda: virtual ranks on one GPU (VirtualTailGroup). All ranks' kernels run one after
another on one stream, so the fused time is for ALL ranks together (printed divided by TP); the
baseline is one rank's unfused compute (RMSNorm + full up-projection + adds) with its
all-reduces replaced by sums over the partials (no communication at all). Both are timed as
CUDA-graph replays (how decode runs them) and eagerly.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from service.tail.base import rms_norm, unfused_tail  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _iters(m: int, scale: float) -> int:
    return max(10, int(scale * 400 / (1 + m // 8)))


def _inputs(seed: int, m: int, latent: int, hidden: int, dtype, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(m, latent, generator=g).to(device, dtype),
            torch.randn(m, hidden, generator=g).to(device, dtype))


def _weights(latent: int, hidden: int, dtype, device="cpu"):
    g = torch.Generator().manual_seed(1)
    return ((torch.randn(hidden, latent, generator=g) / latent**0.5).to(device, dtype),
            (torch.rand(latent, generator=g) + 0.5).to(device, dtype))


# ---- CPU: rank processes ----------------------------------------------------------------------

def _unfused_cpu(group, routed, shared, norm, up):
    # all_reduce works in place: keep the inputs intact for the next iteration.
    return unfused_tail(group, routed.clone(), shared.clone(), norm, up, 1e-6)


def _cpu_rank(rank, tp, port, args, queue):
    import torch.distributed as dist

    from service.parallel import TPGroup
    from service.tail.shm import ShmTailCollective

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp,
                            timeout=datetime.timedelta(seconds=600))
    group = TPGroup(rank, tp, dist.group.WORLD)
    dtype = DTYPES[args.dtype]
    coll = ShmTailCollective(rank, tp, max_tokens=max(args.m), latent_dim=args.latent, hidden_dim=args.hidden,
                             dtype=dtype, state_alloc=lambda n, s, d: torch.zeros(s, dtype=d),
                             group_name=f"bench{port}", barrier=group.barrier)
    up, norm = _weights(args.latent, args.hidden, dtype)
    for m in args.m:
        routed, shared = _inputs(rank, m, args.latent, args.hidden, dtype)
        n = _iters(m, args.scale)
        row = {"m": m, "iters": n}
        fused = partial(coll.fused_tail, routed, shared, norm, up, 1e-6)
        unfused = partial(_unfused_cpu, group, routed, shared, norm, up)
        for name, fn in (("fused", fused), ("unfused", unfused)):
            for _ in range(max(3, n // 10)):
                fn()
            group.barrier()
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            row[name] = (time.perf_counter() - t0) / n * 1e6
            group.barrier()
        if rank == 0:
            queue.put(row)
    coll.close()
    group.barrier()
    dist.destroy_process_group()


def bench_cpu(args) -> None:
    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    for tp in args.tp:
        queue = ctx.Queue()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        procs = mp.start_processes(_cpu_rank, args=(tp, port, args, queue), nprocs=tp, join=False,
                                   start_method="spawn")
        print(f"\nTP {tp} (CPU processes, {args.dtype}, H={args.hidden}, L={args.latent}, "
              f"{os.cpu_count()} cores)", flush=True)
        print(f"{'M':>5} {'iters':>6} {'fused us':>10} {'unfused us':>11} {'unfused/fused':>14}", flush=True)
        for _ in args.m:
            row = queue.get(timeout=1800)
            print(f"{row['m']:>5} {row['iters']:>6} {row['fused']:>10.1f} {row['unfused']:>11.1f} "
                  f"{row['unfused'] / row['fused']:>14.2f}", flush=True)
        procs.join()


# ---- CUDA: virtual ranks on one GPU -----------------------------------------------------------

def _time_eager(fn, n: int) -> float:
    """Wall time per call with Python launches included (median of 3 runs)."""
    for _ in range(max(3, n // 10)):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(samples)


def _time_graph(fn, n: int):
    """GPU time per replay of `fn` captured in a CUDA graph, as serving replays decode steps
    (median of 3 runs). Returns (us, outputs of the captured call)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    samples = []
    for _ in range(3):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            graph.replay()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop) / n * 1e3)
    return statistics.median(samples), out, graph


def _unfused_compute(routed, shared, norm, up):
    latent = rms_norm(torch.stack(routed).sum(0), norm, 1e-6)
    return latent @ up.t() + torch.stack(shared).sum(0)


def bench_cuda(args) -> None:
    from service.tail.triton_tail import VirtualTailGroup

    dtype, dev = DTYPES[args.dtype], "cuda"
    up, norm = _weights(args.latent, args.hidden, dtype, dev)
    print(f"GPU: {torch.cuda.get_device_name()}  ({args.dtype}, H={args.hidden}, L={args.latent})", flush=True)
    print("fused: all TP ranks' tails, serial on one stream; per rank = that / TP. unfused: ONE rank's\n"
          "compute (RMSNorm + full up-projection + adds) with its two all-reduces replaced by sums,\n"
          "i.e. no communication at all. graph = CUDA-graph replay (GPU time), eager = Python launches\n"
          "+ one host read of the error words per call. ratio = unfused / fused-per-rank (graph).", flush=True)
    for tp in args.tp:
        group = VirtualTailGroup(tp, max_tokens=max(args.m), latent_dim=args.latent, hidden_dim=args.hidden,
                                 dtype=dtype, device=dev)
        print(f"\nvirtual TP {tp}", flush=True)
        print(f"{'M':>5} {'fused/rank graph us':>20} {'unfused graph us':>17} {'ratio':>6} "
              f"{'fused/rank eager us':>20} {'unfused eager us':>17} {'max|graph-ref|':>15}", flush=True)
        for m in args.m:
            parts = [_inputs(100 + r, m, args.latent, args.hidden, dtype, dev) for r in range(tp)]
            routed, shared = [p[0] for p in parts], [p[1] for p in parts]
            n = _iters(m, args.scale)
            fused_fn = partial(group.fused_tail, routed, shared, norm, up, 1e-6)
            base_fn = partial(_unfused_compute, routed, shared, norm, up)
            fused_eager = _time_eager(fused_fn, n) / tp
            base_eager = _time_eager(base_fn, n)
            fused_graph, outs, g1 = _time_graph(partial(fused_fn, check=False), n)
            group.check()  # a deadline hit during the replays would surface here
            base_graph, ref, g2 = _time_graph(base_fn, n)
            err = max((o.float() - ref.float()).abs().max().item() for o in outs)
            print(f"{m:>5} {fused_graph / tp:>20.1f} {base_graph:>17.1f} {base_graph / (fused_graph / tp):>6.2f} "
                  f"{fused_eager:>20.1f} {base_eager:>17.1f} {err:>15.3g}", flush=True)
            del g1, g2
        group.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--tp", default="2,4,8", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--m", default="1,2,4,8,16,32,64,128", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--latent", type=int, default=1024)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies the iteration counts")
    args = ap.parse_args()
    if args.device == "cuda":
        bench_cuda(args)
    else:
        bench_cpu(args)


if __name__ == "__main__":
    main()
