"""Device all-reduce / all-gather (service/tail/device_comm.py) against torch, on virtual ranks.

All ranks are objects of this process, each with its own mapping of its peers' comm regions
(VirtualTailGroup per channel); each op runs step by step across the ranks (push all, collect
all, finish all), so every wait depends only on work already launched. Needs CUDA and Triton;
with TRITON_INTERPRET=1 the same kernels run on host memory (CPU CI exercises the protocol):
    TRITON_INTERPRET=1 PYTHONPATH=/tmp/tritonpath python -m pytest tests/gpu/test_device_comm.py
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from kernel_env import DEVICE, INTERPRET, kernel_marks, require_kernel_device

triton = require_kernel_device()

from service.tail import device_comm  # noqa: E402
from service.tail.device_comm import DeviceCollectives, DeviceCommTimeout  # noqa: E402
from service.tail.triton_tail import VirtualTailGroup  # noqa: E402

pytestmark = kernel_marks(600)
MAX_TOKENS = 8
HIDDEN, VOCAB_SHARD = (48, 40) if INTERPRET else (1024, 4000)


def virtual(tp: int, deadline_s: float = 10.0):
    widths = {torch.bfloat16: HIDDEN, torch.float32: max(HIDDEN, VOCAB_SHARD)}
    groups = [VirtualTailGroup(tp, max_tokens=MAX_TOKENS, latent_dim=w, hidden_dim=tp, dtype=dt,
                               deadline_s=deadline_s, device=DEVICE) for dt, w in widths.items()]
    ranks = [DeviceCollectives(r, tp, {g.ranks[r].dtype: g.ranks[r] for g in groups}) for r in range(tp)]
    return groups, ranks


def close(groups, ranks):
    for c in ranks:
        device_comm._REGISTRY.pop(c.handle, None)
    for g in groups:
        g.close()


def run_all(ranks, xs, gather: bool, check: bool = True):
    x2s = [x.reshape(-1, x.shape[-1]).contiguous() for x in xs]
    for c, x in zip(ranks, x2s):
        c.push(x)
    outs = [c.collect(x, gather) for c, x in zip(ranks, x2s)]
    for c, x in zip(ranks, x2s):
        c.finish(x)
    if check:
        for c in ranks:
            c.check()
    return outs


def reference_sum(xs):
    acc = torch.zeros_like(xs[0], dtype=torch.float32)
    for x in xs:  # rank order, fp32, as the kernel sums
        acc = acc + x.float()
    return acc.to(xs[0].dtype)


@pytest.mark.parametrize("tp", [2, 4])
def test_all_reduce_and_all_gather_match_torch_bitwise_on_every_rank(tp, monkeypatch):
    monkeypatch.setattr(device_comm, "_TILE", 16)  # several column tiles per row, even at these widths
    groups, ranks = virtual(tp)
    try:
        g = torch.Generator().manual_seed(tp)
        # Mixed ops, dtypes and row counts in one sequence: the triple buffers and the slot
        # clearing of one call are what the next calls stand on.
        for step, (dtype, m, width, gather) in enumerate([
                (torch.bfloat16, 1, HIDDEN, False), (torch.float32, 3, VOCAB_SHARD, True),
                (torch.bfloat16, MAX_TOKENS, HIDDEN, False), (torch.bfloat16, 2, HIDDEN, False),
                (torch.float32, MAX_TOKENS, VOCAB_SHARD, True), (torch.float32, 5, HIDDEN, False),
                (torch.bfloat16, 1, HIDDEN, False)]):
            xs = [torch.randn(m, width, generator=g).to(dtype).to(DEVICE) for _ in range(tp)]
            outs = run_all(ranks, xs, gather)
            want = torch.cat(xs, dim=-1) if gather else reference_sum(xs)
            for r, out in enumerate(outs):
                assert out.dtype == dtype and out.shape == want.shape, (step, r)
                assert torch.equal(out, want), f"step {step} rank {r}: not the bits of the torch result"
        # Each call advances its dtype's channel once, on every rank alike (epochs start at 1).
        assert all(c.epochs() == {"bf16": 5, "fp32": 4} for c in ranks), [c.epochs() for c in ranks]
    finally:
        close(groups, ranks)


def test_fits_only_decode_sized_payloads_of_its_dtypes():
    groups, ranks = virtual(2)
    try:
        c = ranks[0]
        assert c.fits(torch.zeros(MAX_TOKENS, HIDDEN, dtype=torch.bfloat16, device=DEVICE))
        assert not c.fits(torch.zeros(MAX_TOKENS + 1, HIDDEN, dtype=torch.bfloat16, device=DEVICE))
        assert not c.fits(torch.zeros(2, HIDDEN, dtype=torch.float16, device=DEVICE))
    finally:
        close(groups, ranks)


def test_lost_peer_and_lost_flags_end_in_a_bounded_timeout_then_rearm_serves():
    groups, ranks = virtual(2, deadline_s=0.5)
    try:
        xs = [torch.ones(2, HIDDEN, dtype=torch.bfloat16, device=DEVICE) * (r + 1) for r in range(2)]
        run_all(ranks, xs, gather=False)
        # Lost peer: rank 1 never pushes; rank 0's collect gives up and names it.
        x2 = xs[0]
        ranks[0].push(x2)
        ranks[0].collect(x2, gather=False)
        ranks[0].finish(x2)
        with pytest.raises(DeviceCommTimeout, match=r"rank 0.*peers \[1\]"):
            ranks[0].check()
        # Every rank re-arms (as recovery.py does), then the collective serves again.
        for c in ranks:
            c.rearm()
        out = run_all(ranks, xs, gather=False)
        assert all(torch.equal(o, reference_sum(xs)) for o in out)
        # Lost flags on one rank: the ranks disagree about the buffers and time out, never hang.
        ranks[1].zero_flags()
        with pytest.raises(DeviceCommTimeout):
            run_all(ranks, xs, gather=False)
    finally:
        close(groups, ranks)


# ---- one process per rank on one GPU (cuMem FDs over Unix sockets), graphs and a lost peer ----

def _inputs(rank: int, step: int, m: int, width: int, dtype, dev):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(m, width, generator=g).to(dtype).to(dev)


def _proc_worker(rank, world_size, port, out_dir):
    import datetime
    import traceback

    import torch.distributed as dist

    from service.parallel import TPGroup

    torch.cuda.set_device(0)
    dev = torch.device("cuda", 0)
    result = {}
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=120))
        tp = TPGroup(rank, world_size, dist.group.WORLD)
        comm = DeviceCollectives.create(
            rank, world_size, max_tokens=MAX_TOKENS, widths={torch.bfloat16: HIDDEN, torch.float32: VOCAB_SHARD},
            state_alloc=lambda n, s, d: torch.zeros(s, dtype=d, device=dev), group_name=f"dcprocs-{port}",
            deadline_s=2.0, barrier=tp.barrier, device=dev)
        outs = []
        for step, (dtype, m, width, gather) in enumerate([
                (torch.bfloat16, 1, HIDDEN, False), (torch.float32, 3, VOCAB_SHARD, True),
                (torch.bfloat16, MAX_TOKENS, HIDDEN, False), (torch.float32, MAX_TOKENS, VOCAB_SHARD, True)]):
            xs = [_inputs(r, step, m, width, dtype, dev) for r in range(world_size)]
            out = comm.all_gather(xs[rank]) if gather else comm.all_reduce(xs[rank])
            want = torch.cat(xs, dim=-1) if gather else reference_sum(xs)
            result[f"eager{step}"] = torch.equal(out, want)
            outs.append(out.cpu())
        # In a CUDA graph: captured once, replayed on new inputs; err read after the replays.
        x = torch.zeros(4, HIDDEN, dtype=torch.bfloat16, device=dev)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            comm.all_reduce(x)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            y = comm.all_reduce(x)
        for step in range(10, 13):
            xs = [_inputs(r, step, 4, HIDDEN, torch.bfloat16, dev) for r in range(world_size)]
            x.copy_(xs[rank])
            graph.replay()
            comm.check()
            result[f"graph{step}"] = torch.equal(y, reference_sum(xs))
            outs.append(y.cpu())
        result["outs"] = outs
        torch.cuda.synchronize()
        tp.barrier()
        if rank == 1:  # the lost peer: gone without a word
            torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
            os._exit(0)
        time.sleep(1.0)
        t0 = time.monotonic()
        try:
            comm.all_reduce(x)
            result["timeout"] = "no error"
        except DeviceCommTimeout as e:
            result["timeout"] = str(e)
        result["elapsed"] = time.monotonic() - t0
    except Exception:
        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    os._exit(0)


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA")
def test_two_processes_on_one_gpu_bitwise_sums_graphs_and_a_lost_peer(tmp_path):
    import torch.multiprocessing as mp

    from service.net import free_port

    ctx = mp.start_processes(_proc_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn",
                             join=False)
    deadline = time.monotonic() + 300
    # join() returns at the first exit (rank 1 leaves early by design): wait for both.
    while not ctx.join(timeout=5) and time.monotonic() < deadline:
        pass
    res = {r: torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)}
    for r, x in res.items():
        assert "error" not in x, f"rank {r}:\n{x['error']}"
        bad = [k for k, v in x.items() if (k.startswith("eager") or k.startswith("graph")) and v is not True]
        assert not bad, f"rank {r}: not the bits of the torch result at {bad}"
    for a, b in zip(res[0]["outs"], res[1]["outs"]):
        assert torch.equal(a, b), "the ranks' results differ"
    assert "peers [1]" in res[0]["timeout"], res[0]["timeout"]
    assert res[0]["elapsed"] < 2.0 + 10, f"the lost peer took {res[0]['elapsed']:.1f}s to report"
