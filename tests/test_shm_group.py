"""The shared-memory TP collectives (service/parallel/shm_group.py), ranks as threads of one process: the
same bits on every rank, payloads larger than a slot, step plans in their binary form, and a
peer that never answers ends in a clear error at the deadline instead of a hang."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
from _thread_ranks import run_ranks as thread_ranks

from service.engine.plan import SeqChunk, StepPlan, decode_message, encode_message
from service.parallel.shm_group import CollectiveTimeout, ShmGroup


def run_ranks(world: int, fn, slot_bytes: int = 4096, deadline_s: float = 20.0) -> list:
    """fn(group) on `world` thread ranks; returns each rank's result (or raised exception)."""
    name = f"test{os.getpid()}-{time.monotonic_ns()}"
    return thread_ranks(world, lambda r, g, barrier: fn(g), lambda r, barrier: ShmGroup(
        r, world, name, barrier, deadline_s=deadline_s, slot_bytes=slot_bytes))


@pytest.mark.parametrize("world", [2, 3, 4])
def test_all_reduce_and_gather_give_every_rank_the_same_bits(world):
    def fn(g):
        x = torch.randn(37, 19, generator=torch.Generator().manual_seed(g.rank))  # 2.8 KB: one slot
        big = torch.randn(5000, generator=torch.Generator().manual_seed(10 + g.rank)).to(torch.bfloat16)
        return (g.all_reduce(x.clone()), g.all_reduce(big.clone()),
                g.all_gather(torch.full((2, 3), float(g.rank)), dim=-1))

    out = run_ranks(world, fn)
    inputs = [torch.randn(37, 19, generator=torch.Generator().manual_seed(r)) for r in range(world)]
    want = sum(inputs[1:], inputs[0].clone())
    for r in range(world):
        reduced, big, gathered = out[r]
        assert torch.equal(reduced, out[0][0]) and torch.equal(big, out[0][1])  # identical bits everywhere
        assert torch.allclose(reduced, want, atol=1e-5)
        assert big.dtype == torch.bfloat16 and big.shape == (5000,)  # 10 KB: three slots of 4 KB
        assert gathered.tolist() == [[float(p) for p in range(world) for _ in range(3)]] * 2


@pytest.mark.parametrize("own_core", [False, True])
def test_in_slot_all_reduce_is_the_rank_order_fp32_sum(own_core):
    """The in-place path (payload fits a slot): fp32 sums straight into t as ((x0 + x1) + x2), bf16
    through an fp32 accumulator, the same bits as the piecewise path for a non-contiguous input,
    and slot views reused across shapes and both slots stay right."""
    world = 3
    shapes = [(16, 8), (4, 8), (16, 8), (1, 8), (16, 8)]

    def inputs(rank: int, i: int, dtype=torch.float32) -> torch.Tensor:
        return torch.randn(*shapes[i], generator=torch.Generator().manual_seed(100 * rank + i)).to(dtype)

    def fn(g):
        out = [g.all_reduce(inputs(g.rank, i)) for i in range(len(shapes))]
        out.append(g.all_reduce(inputs(g.rank, 0, torch.bfloat16)))
        out.append(g.all_reduce(inputs(g.rank, 0).t()))  # not contiguous: the piecewise path
        out.append(g.all_gather(inputs(g.rank, 1), dim=0))
        return out

    name = f"test{os.getpid()}-{time.monotonic_ns()}"
    res = thread_ranks(world, lambda r, g, barrier: fn(g), lambda r, barrier: ShmGroup(
        r, world, name, barrier, deadline_s=20.0, slot_bytes=4096, own_core=own_core))
    for i in range(len(shapes)):
        want = (inputs(0, i) + inputs(1, i)) + inputs(2, i)
        assert all(torch.equal(res[r][i], want) for r in range(world))
    want_bf16 = ((inputs(0, 0, torch.bfloat16).float() + inputs(1, 0, torch.bfloat16)) + inputs(2, 0, torch.bfloat16))
    assert all(torch.equal(res[r][5], want_bf16.to(torch.bfloat16)) for r in range(world))
    assert all(torch.equal(res[r][6], res[0][0].t()) for r in range(world))
    assert all(torch.equal(res[r][7], torch.cat([inputs(p, 1) for p in range(world)])) for r in range(world))


def test_step_plans_broadcast_in_binary_form():
    plan = StepPlan([SeqChunk(7, list(range(900)), 0, [3, 1, 2], True, 5),  # 7 KB message: two slots
                     SeqChunk(9, [42], 63, [8, 9, 10, 11], False, 0)])

    def fn(g):
        got = [decode_message(g.broadcast_ints(encode_message("step", plan) if g.rank == 0 else None))
               for _ in range(3)]
        got.append(decode_message(g.broadcast_ints(encode_message("stop") if g.rank == 0 else None)))
        return got

    for got in run_ranks(3, fn):
        assert got[:3] == [("step", plan)] * 3 and got[3] == ("stop", None)


def test_a_peer_that_never_comes_ends_in_a_timely_named_error():
    def fn(g):
        if g.rank == 1:
            return None  # never joins the all-reduce
        start = time.perf_counter()
        with pytest.raises(CollectiveTimeout, match=r"TP rank 0: shared-memory all_reduce \(op 1\)"):
            g.all_reduce(torch.ones(4))
        return time.perf_counter() - start

    elapsed, _ = run_ranks(2, fn, deadline_s=0.5)
    assert 0.5 <= elapsed < 5


def test_a_follower_idles_past_the_deadline_waiting_for_a_plan():
    def fn(g):
        if g.rank == 0:
            time.sleep(0.6)  # longer than the deadline: an idle engine
            return g.broadcast_ints(np.array([1, 2, 3]))
        return g.broadcast_ints(None, wait_forever=True)

    assert [list(r) for r in run_ranks(2, fn, deadline_s=0.2)] == [[1, 2, 3]] * 2
