"""GPU fused tail (Triton): virtual TP ranks on one GPU, and two real processes sharing it.

Needs CUDA and Triton (the GPU machine); skipped elsewhere. With TRITON_INTERPRET=1 and
Triton installed, the virtual-rank tests also run on a CPU (kernels interpreted, no PTX).
"""

from __future__ import annotations

import datetime
import os
import time
import traceback

import pytest
import torch
from kernel_env import DEVICE, INTERPRET, kernel_marks, require_kernel_device

triton = require_kernel_device()

from tail_cases import EPS, HIDDEN, LATENT, M_SEQUENCE, MAX_TOKENS, rel_err, tail_inputs, tail_weights  # noqa: E402

from service.net import free_port  # noqa: E402
from service.tail.base import TailTimeout, latent_norm, unfused_tail  # noqa: E402
from service.tail.triton_tail import VirtualTailGroup  # noqa: E402

# Interpreted runs are CPU runs: the gpu marker would make conftest skip them.
pytestmark = kernel_marks(600)


def _reference(routed, shared, norm, up):
    """The unfused tail with the all-reduces done as sums over the virtual ranks."""
    latent = latent_norm(torch.stack(routed).sum(0), norm, EPS)
    return latent @ up.t() + torch.stack(shared).sum(0)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)], ids=["fp32", "bf16"])
def test_fused_matches_unfused(tp, dtype, tol):
    group = VirtualTailGroup(tp, max_tokens=MAX_TOKENS, latent_dim=LATENT, hidden_dim=HIDDEN, dtype=dtype,
                             deadline_s=5.0, device=DEVICE)
    up, norm = tail_weights(dtype, DEVICE)
    try:
        for i, m in enumerate(M_SEQUENCE):
            routed, shared = tail_inputs(tp, m, 100 + i, dtype, DEVICE)
            outs = group.fused_tail(routed, shared, norm if i % 2 == 0 else None, up, EPS)
            ref = _reference(routed, shared, norm if i % 2 == 0 else None, up)
            err = rel_err(outs[0], ref)
            assert err <= tol, f"M={m}: error {err:.2e}"
            for r, out in enumerate(outs[1:], start=1):
                assert torch.equal(out, outs[0]), f"rank {r} differs at M={m}"
        assert [c.epoch() for c in group.ranks] == [1 + len(M_SEQUENCE)] * tp
    finally:
        group.close()


def test_lost_flags_end_in_timeout():
    tp, dtype, deadline = 2, torch.float32, 1.0
    group = VirtualTailGroup(tp, max_tokens=16, latent_dim=LATENT, hidden_dim=HIDDEN, dtype=dtype,
                             deadline_s=deadline, device=DEVICE)
    up, norm = tail_weights(dtype, DEVICE)
    try:
        for i in range(4):
            group.fused_tail(*tail_inputs(tp, 3, i, dtype, DEVICE), norm, up, EPS)
        group.zero_flags()
        for call in range(1, 4):
            routed, shared = tail_inputs(tp, 3, 10 + call, dtype, DEVICE)
            t0 = time.perf_counter()
            try:
                outs = group.fused_tail(routed, shared, norm, up, EPS)
            except TailTimeout as e:
                assert "epoch" in str(e) and "buffer" in str(e)
                assert time.perf_counter() - t0 < 10 * deadline + 30
                break
            assert rel_err(outs[0], _reference(routed, shared, norm, up)) < 1e-5, "garbage after lost flags"
        else:
            pytest.fail("no TailTimeout within 3 calls after the flags were zeroed")
        # The error stays: later calls fail fast instead of computing on broken state.
        with pytest.raises(TailTimeout):
            group.fused_tail(*tail_inputs(tp, 3, 99, dtype, DEVICE), norm, up, EPS)
    finally:
        group.close()


def test_rearm_after_lost_flags_serves_again():
    """Recovery in place (service/cluster/recovery.py): after the timeout every rank re-arms (own region
    refilled, flags initial, error words cleared) and the next calls are right again."""
    tp, dtype = 2, torch.float32
    group = VirtualTailGroup(tp, max_tokens=16, latent_dim=LATENT, hidden_dim=HIDDEN, dtype=dtype,
                             deadline_s=1.0, device=DEVICE)
    up, norm = tail_weights(dtype, DEVICE)
    try:
        for i in range(4):
            group.fused_tail(*tail_inputs(tp, 3, i, dtype, DEVICE), norm, up, EPS)
        group.zero_flags()
        with pytest.raises(TailTimeout):
            for call in range(1, 4):
                group.fused_tail(*tail_inputs(tp, 3, 10 + call, dtype, DEVICE), norm, up, EPS)
        group.rearm()
        for call in range(5):
            routed, shared = tail_inputs(tp, 3 + call, 20 + call, dtype, DEVICE)
            outs = group.fused_tail(routed, shared, norm, up, EPS)
            assert rel_err(outs[0], _reference(routed, shared, norm, up)) < 1e-5, f"call {call} after rearm"
            assert torch.equal(outs[0], outs[1])
        assert [c.epoch() for c in group.ranks] == [1 + 5] * tp
    finally:
        group.close()


def test_peer_table_is_what_the_kernels_use():
    tp, dtype = 2, torch.float32
    group = VirtualTailGroup(tp, max_tokens=16, latent_dim=LATENT, hidden_dim=HIDDEN, dtype=dtype,
                             deadline_s=1.0, device=DEVICE)
    up, norm = tail_weights(dtype, DEVICE)
    try:
        routed, shared = tail_inputs(tp, 4, 7, dtype, DEVICE)
        table = group.ranks[0].peer_ptrs
        table[[0, 1]] = table[[1, 0]].clone()  # rank 0 now stores peer 1's share at home
        try:
            outs = group.fused_tail(routed, shared, norm, up, EPS)
            changed = rel_err(outs[1], _reference(routed, shared, norm, up)) > 1e-3
        except TailTimeout:
            changed = True
        assert changed
    finally:
        group.close()


# ---- two processes sharing the GPU: FD export over Unix sockets, gloo for the reference ------

def _two_process_worker(rank, world_size, port, out_dir):
    import torch.distributed as dist

    from service.parallel import TPGroup
    from service.tail.triton_tail import TritonTailCollective
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    tp = TPGroup(rank, world_size, dist.group.WORLD)
    result = {}
    try:
        dtype = torch.bfloat16
        coll = TritonTailCollective(rank, world_size, max_tokens=16, latent_dim=LATENT, hidden_dim=HIDDEN,
                                    dtype=dtype, state_alloc=lambda n, s, d: torch.zeros(s, dtype=d, device="cuda"),
                                    group_name=f"t2p{port}", deadline_s=20.0, barrier=tp.barrier, device="cuda")
        up, norm = tail_weights(dtype, DEVICE)
        errs = []
        for i, m in enumerate((1, 5, 16)):
            routed, shared = tail_inputs(world_size, m, 40 + i, dtype, DEVICE)
            out = coll.fused_tail(routed[rank], shared[rank], norm, up, EPS)
            ref = unfused_tail(tp, routed[rank].cpu(), shared[rank].cpu(), norm.cpu(), up.cpu(), EPS)
            errs.append(rel_err(out.cpu(), ref))
        result = {"errs": errs, "out": out.cpu(), "epoch": coll.epoch()}
        coll.close()
    except Exception:
        result = {"error": traceback.format_exc()}
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.mark.skipif(INTERPRET or not torch.cuda.is_available(), reason="needs CUDA")
def test_two_processes_share_comm_through_fds(tmp_path):
    import torch.multiprocessing as mp
    mp.start_processes(_two_process_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    res = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for r, x in enumerate(res):
        assert "error" not in x, f"rank {r}:\n{x['error']}"
        assert max(x["errs"]) < 2e-2 and x["epoch"] == 4
    assert torch.equal(res[0]["out"], res[1]["out"])
