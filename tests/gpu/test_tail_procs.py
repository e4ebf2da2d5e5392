"""GPU fused tail with one real process per rank (TP 2 and 4): fused == unfused.

Rank r runs on GPU r % device_count(). With a GPU per rank the process group is NCCL and the
unfused reference runs on the GPU; with fewer GPUs than ranks several processes share a GPU
(time-sliced; NCCL refuses two ranks on one GPU), so the group is gloo and the reference runs
on CPU copies. Peers' comm regions travel as cuMem FDs over abstract Unix sockets either way.
Needs CUDA and Triton; skipped elsewhere.
"""

from __future__ import annotations

import datetime
import os
import traceback

import pytest
import torch

triton = pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from tail_cases import EPS, HIDDEN, LATENT, M_SEQUENCE, MAX_TOKENS, rel_err, tail_inputs, tail_weights  # noqa: E402

from service.net import free_port  # noqa: E402
from service.tail.base import unfused_tail  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(300)]
DEADLINE_S = 30.0
DTYPES = {"fp32": (torch.float32, 1e-5), "bf16": (torch.bfloat16, 2e-2)}


def _worker(rank, world_size, port, out_dir, dtype_name):
    # Before anything touches CUDA: this rank's GPU.
    ndev = torch.cuda.device_count()
    idx = rank % ndev
    torch.cuda.set_device(idx)
    dev = torch.device("cuda", idx)
    # The reference's RMSNorm eagerly: compiling it in every rank would cost more than the test.
    os.environ["LATENTSERVE_COMPILE"] = "0"

    import torch.distributed as dist

    from service.parallel import TPGroup
    from service.tail.triton_tail import TritonTailCollective

    backend = "nccl" if ndev >= world_size else "gloo"
    kwargs = {"device_id": dev} if backend == "nccl" else {}
    result, failed = {}, False
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=120), **kwargs)
        tp = TPGroup(rank, world_size, dist.group.WORLD)
        dtype = DTYPES[dtype_name][0]
        coll = TritonTailCollective(
            rank, world_size, max_tokens=MAX_TOKENS, latent_dim=LATENT, hidden_dim=HIDDEN, dtype=dtype,
            state_alloc=lambda n, s, d: torch.zeros(s, dtype=d, device=dev),
            group_name=f"tprocs-{world_size}-{dtype_name}-{port}", deadline_s=DEADLINE_S, barrier=tp.barrier,
            device=f"cuda:{idx}")
        up, norm = tail_weights(dtype, dev)
        errs, outs = [], []
        for i, m in enumerate(M_SEQUENCE):
            routed, shared = tail_inputs(world_size, m, 100 + i, dtype, dev)
            nw = norm if i % 2 == 0 else None
            out = coll.fused_tail(routed[rank], shared[rank], nw, up, EPS)
            if backend == "nccl":  # all_reduce works in place: the reference gets copies
                ref = unfused_tail(tp, routed[rank].clone(), shared[rank].clone(), nw, up, EPS)
            else:
                ref = unfused_tail(tp, routed[rank].cpu(), shared[rank].cpu(),
                                   None if nw is None else nw.cpu(), up.cpu(), EPS)
            errs.append(rel_err(out, ref))
            outs.append(out.cpu())
        result = {"errs": errs, "outs": outs, "epoch": coll.epoch(), "backend": backend, "gpu": idx}
        torch.cuda.synchronize()
        tp.barrier()  # every peer is done with this rank's region before it goes
        coll.close()
    except Exception:
        result, failed = {"error": traceback.format_exc(), "backend": backend, "gpu": idx}, True
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    if failed:
        # Exit at once (no collective teardown that could wait on a broken peer): the parent's
        # join sees the failure, stops the other ranks, and the test reads this traceback.
        os._exit(1)
    dist.destroy_process_group()


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
@pytest.mark.parametrize("tp", [2, 4])
def test_fused_matches_unfused_across_processes(tp, dtype_name, tmp_path):
    import torch.multiprocessing as mp

    port = free_port()
    spawn_error = None
    try:
        mp.start_processes(_worker, args=(tp, port, str(tmp_path), dtype_name), nprocs=tp,
                           start_method="spawn")
    except Exception as e:  # a rank failed: report its own traceback below when it saved one
        spawn_error = e
    res = {}
    for r in range(tp):
        path = tmp_path / f"rank{r}.pt"
        if path.exists():
            res[r] = torch.load(path, weights_only=False)
    for r, x in res.items():
        assert "error" not in x, f"rank {r} (GPU {x['gpu']}, {x['backend']}):\n{x['error']}"
    if spawn_error is not None:
        raise spawn_error
    assert sorted(res) == list(range(tp)), f"results only from ranks {sorted(res)}"

    tol = DTYPES[dtype_name][1]
    for r, x in res.items():
        bad = [(m, e) for m, e in zip(M_SEQUENCE, x["errs"]) if not e <= tol]
        assert not bad, f"rank {r} ({x['backend']}): fused vs unfused error above {tol:g} at (M, err) {bad}"
        # The epoch starts at 1 (protocol.INITIAL_FLAGS) and every call advances it once.
        assert x["epoch"] == 1 + len(M_SEQUENCE), f"rank {r}: epoch {x['epoch']}"
    for i, m in enumerate(M_SEQUENCE):
        for r in range(1, tp):
            assert torch.equal(res[r]["outs"][i], res[0]["outs"][i]), f"rank {r} differs from rank 0 at call {i} (M={m})"
