"""Fused vs unfused MoE tail latency per call, for decode-sized batches.

CPU (default): real TP rank processes on this machine; the fused tail is ShmTailCollective,
the unfused one is `unfused_tail` over gloo (two all-reduces + the full up-projection).
    python bench/tail.py --tp 2,4,8 --m 1,2,4,8,16,32,64,128

--device cuda: virtual ranks on one GPU (VirtualTailGroup). All ranks' kernels run one after
another on one stream, so the fused time is for ALL ranks together (printed divided by TP); the
baseline is one rank's unfused compute (RMSNorm + full up-projection + adds) with its
all-reduces replaced by sums over the partials (no communication at all). Both are timed as
CUDA-graph replays (how decode runs them) and eagerly.
    python3 bench/tail.py --device cuda --tp 2,4,8

--device cuda --procs: real rank processes (spawned), one per rank, rank r on GPU
r % device_count(); the fused tail is TritonTailCollective (peers' comm mapped through cuMem
FDs), the unfused one the real `unfused_tail` over the process group: NCCL all-reduces when
every rank has a GPU of its own, else gloo (NCCL refuses two ranks on one GPU; up to 2 ranks
share a GPU, time-sliced, with a tenth of the iterations: slow, for correctness more than
speed). Every rank times both eagerly (wall time per call, Python launches included) and as
CUDA-graph replays in lockstep across the ranks (the fused tail captured without its host-side
error check, which runs after the replays; gloo collectives cannot be captured: n/a). Rank 0's
times are printed; the error column is the worst rank's.
    python3 bench/tail.py --device cuda --procs --tp 2,4,8
    python3 bench/tail.py --device cuda --procs --tp 2 --scale 0.3   # one GPU, 2 ranks sharing it
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import os
import queue as queue_mod
import statistics
import sys
import time
from functools import partial

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from service.net import free_port  # noqa: E402
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

def _unfused(group, routed, shared, norm, up):
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
        unfused = partial(_unfused, group, routed, shared, norm, up)
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
        port = free_port()
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


# ---- CUDA timing ------------------------------------------------------------------------------

def _no_barrier() -> None:
    pass


def _time_eager(fn, n: int, barrier=_no_barrier) -> float:
    """Wall time per call with Python launches included (median of 3 runs; with rank processes,
    every run starts on all ranks together)."""
    for _ in range(max(3, n // 10)):
        fn()
    samples = []
    for _ in range(3):
        torch.cuda.synchronize()
        barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
        samples.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(samples)


def _time_graph(fn, n: int, barrier=_no_barrier):
    """GPU time per replay of `fn` captured in a CUDA graph, as serving replays decode steps
    (median of 3 runs). Returns (us, outputs of the captured call, graph). With rank processes,
    every rank warms up, captures and replays the same number of times, each run after a
    barrier: the fused tail spins on its peers, so the ranks must replay in lockstep."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # thread_local: the process group's threads (NCCL watchdog, gloo) may touch CUDA meanwhile.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        out = fn()
    samples = []
    for _ in range(3):
        torch.cuda.synchronize()
        barrier()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            graph.replay()
        stop.record()
        stop.synchronize()
        samples.append(start.elapsed_time(stop) / n * 1e3)
    return statistics.median(samples), out, graph


# ---- CUDA: virtual ranks on one GPU -----------------------------------------------------------

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


# ---- CUDA: rank processes (--procs) -----------------------------------------------------------

def _rel_err(out, ref) -> float:
    out, ref = out.float(), ref.float()
    return ((out - ref).abs().max() / ref.abs().max()).item()


def _digest(*tensors) -> str:
    h = hashlib.sha1()
    for t in tensors:
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _share(tp: int, ndev: int) -> int:
    """Ranks per GPU (the most on any GPU)."""
    return -(-tp // ndev)


def _cuda_rank(rank, tp, port, args, queue):
    ndev = torch.cuda.device_count()
    idx = rank % ndev
    torch.cuda.set_device(idx)  # before anything touches CUDA
    dev = torch.device("cuda", idx)

    import torch.distributed as dist

    from service.parallel import TPGroup
    from service.tail.triton_tail import TritonTailCollective

    nccl = ndev >= tp
    kwargs = {"device_id": dev} if nccl else {}
    dist.init_process_group("nccl" if nccl else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=tp, timeout=datetime.timedelta(seconds=600), **kwargs)
    group = TPGroup(rank, tp, dist.group.WORLD)
    dtype = DTYPES[args.dtype]
    coll = TritonTailCollective(rank, tp, max_tokens=max(args.m), latent_dim=args.latent, hidden_dim=args.hidden,
                                dtype=dtype, state_alloc=lambda n, s, d: torch.zeros(s, dtype=d, device=dev),
                                group_name=f"benchcuda{tp}-{port}", deadline_s=30.0, barrier=group.barrier,
                                device=f"cuda:{idx}")
    up, norm = _weights(args.latent, args.hidden, dtype, dev)
    share = _share(tp, ndev)
    for i, m in enumerate(args.m):
        routed, shared = _inputs(100 + rank, m, args.latent, args.hidden, dtype, dev)
        n = _iters(m, args.scale)
        if share > 1:
            n = max(10, n // 10)
        fused = partial(coll.fused_tail, routed, shared, norm, up, 1e-6)
        unfused = partial(_unfused, group, routed, shared, norm, up)
        row = {"rank": rank, "i": i, "m": m, "iters": n}
        row["fused_eager"] = _time_eager(fused, n, group.barrier)
        row["unfused_eager"] = _time_eager(unfused, n, group.barrier)
        row["fused_graph"], graph_out, g1 = _time_graph(partial(fused, check=False), n, group.barrier)
        coll.check()  # a deadline hit during the replays would surface here
        g2 = None
        row["unfused_graph"] = None
        if nccl:
            row["unfused_graph"], _ref, g2 = _time_graph(unfused, n, group.barrier)
        # One more eager call of each on every rank (same count everywhere), for the errors.
        eager_out = fused()
        ref = unfused()
        row["err"] = max(_rel_err(eager_out, ref), _rel_err(graph_out, ref))
        row["digest"] = _digest(eager_out, graph_out)
        queue.put(row)
        del g1, g2
    torch.cuda.synchronize()
    group.barrier()  # every peer is done with this rank's comm region before it goes
    coll.close()
    group.barrier()
    dist.destroy_process_group()


def _next_row(queue, procs):
    """The next row from the ranks; raises (the other ranks stopped) as soon as a rank fails."""
    while True:
        try:
            return queue.get(timeout=5)
        except queue_mod.Empty:
            pass
        if procs.join(timeout=0.01):  # raises when a rank failed; True: every rank is gone
            try:
                return queue.get(timeout=5)
            except queue_mod.Empty:
                raise RuntimeError("the ranks exited without reporting every row") from None


def bench_cuda_procs(args) -> None:
    import torch.multiprocessing as mp

    ndev = torch.cuda.device_count()
    if ndev == 0:
        raise SystemExit("--procs needs a CUDA GPU")
    too_many = [tp for tp in args.tp if tp > 2 * ndev]
    if too_many:
        raise SystemExit(f"refusing TP {too_many} on {ndev} GPU(s): more than 2 rank processes per GPU "
                         f"(time-sliced spinning ranks) is too much sharing; use --tp <= {2 * ndev}")
    names = [torch.cuda.get_device_name(i) for i in range(ndev)]
    print(f"{ndev} GPU(s): " + ", ".join(f"cuda:{i} {n}" for i, n in enumerate(names))
          + f"  ({args.dtype}, H={args.hidden}, L={args.latent})", flush=True)
    print("real rank processes, rank r on GPU r % GPUs. fused: TritonTailCollective (one rank's time,\n"
          "rank 0). unfused: unfused_tail over the process group (two all-reduces + RMSNorm + the full\n"
          "up-projection). eager = wall time per call (Python launches; the fused tail reads its error\n"
          "words each call); graph = CUDA-graph replay (GPU time; fused captured without the check).\n"
          "ratio = unfused / fused. err = max |fused - unfused| / max |unfused| over ranks and both\n"
          "fused outputs; agree = the fused outputs are bit-identical on every rank.", flush=True)
    ctx = mp.get_context("spawn")
    for tp in args.tp:
        share = _share(tp, ndev)
        used = min(tp, ndev)
        queue = ctx.Queue()
        port = free_port()
        if share == 1:
            how = f"{tp} GPUs, one rank each; unfused over NCCL"
        else:
            how = (f"{used} GPU(s) shared by up to {share} ranks each (time-sliced, iterations / 10); "
                   f"unfused over gloo on CUDA tensors (NCCL refuses two ranks on one GPU)")
        print(f"\nTP {tp} processes: {how}", flush=True)
        procs = mp.start_processes(_cuda_rank, args=(tp, port, args, queue), nprocs=tp, join=False,
                                   start_method="spawn")
        print(f"{'M':>5} {'iters':>6} {'fused eager us':>15} {'unfused eager us':>17} {'ratio':>6} "
              f"{'fused graph us':>15} {'unfused graph us':>17} {'ratio':>6} {'err':>9} {'agree':>6}", flush=True)
        pending: dict[int, list[dict]] = {}
        for i in range(len(args.m)):
            while len(pending.get(i, [])) < tp:  # the ranks' rows arrive in any order
                row = _next_row(queue, procs)
                pending.setdefault(row["i"], []).append(row)
            rows = pending.pop(i)
            r0 = next(r for r in rows if r["rank"] == 0)
            err = max(r["err"] for r in rows)
            agree = "yes" if len({r["digest"] for r in rows}) == 1 else "NO"
            ug = r0["unfused_graph"]
            ug_s = f"{ug:>17.1f}" if ug is not None else f"{'n/a':>17}"
            ratio_g = f"{ug / r0['fused_graph']:>6.2f}" if ug is not None else f"{'n/a':>6}"
            print(f"{r0['m']:>5} {r0['iters']:>6} {r0['fused_eager']:>15.1f} {r0['unfused_eager']:>17.1f} "
                  f"{r0['unfused_eager'] / r0['fused_eager']:>6.2f} {r0['fused_graph']:>15.1f} {ug_s} {ratio_g} "
                  f"{err:>9.2e} {agree:>6}", flush=True)
        while not procs.join():
            pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--tp", default="2,4,8", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--m", default="1,2,4,8,16,32,64,128", type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--latent", type=int, default=1024)
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies the iteration counts")
    ap.add_argument("--procs", action="store_true",
                    help="with --device cuda: one real process per rank (rank r on GPU r %% GPUs)")
    args = ap.parse_args()
    if args.procs and args.device != "cuda":
        ap.error("--procs needs --device cuda (the CPU mode always runs rank processes)")
    if args.device == "cuda" and args.procs:
        bench_cuda_procs(args)
    elif args.device == "cuda":
        bench_cuda(args)
    else:
        bench_cpu(args)


if __name__ == "__main__":
    main()
