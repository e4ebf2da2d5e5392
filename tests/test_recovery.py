"""Recovery in place after a failed step (service/cluster/recovery.py): the TP group's op counters realigned
(`ShmGroup.resync`, ranks as threads), the fused tail re-armed after lost flags (`rearm`, ranks as
threads), and the whole path through the offline LLM on the 'mp' executor: the step with zeroed
flags fails with the TailTimeout message, the next generation gives the tokens of before."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch
from _thread_ranks import run_ranks

from service.parallel.shm_group import CollectiveTimeout, GroupResync, ShmGroup
from service.tail.base import TailTimeout, latent_norm
from service.tail.protocol import INITIAL_FLAGS
from service.tail.shm import ShmTailCollective


def _group(world: int, deadline_s: float = 20.0):
    name = f"rec{os.getpid()}-{time.monotonic_ns()}"
    return lambda r, barrier: ShmGroup(r, world, name, barrier, deadline_s=deadline_s, slot_bytes=4096)


@pytest.mark.parametrize("world", [2, 3])
def test_resync_realigns_ranks_that_stopped_at_different_ops(world):
    """Rank 0 left its step early; the others wait in a collective it never joins (and one ran an
    extra op): the resync ends their waits at once, then every collective agrees again."""
    def fn(r, g, barrier):
        g.all_reduce(torch.ones(3))
        abandoned = None
        if r == 0:
            time.sleep(0.2)  # the others are waiting by now
            t0 = time.perf_counter()
            g.resync(5.0)
            abandoned = time.perf_counter() - t0
        else:
            if r == 1:
                g.broadcast_ints(np.array([7]), src=1)  # an op nobody else runs
            with pytest.raises(GroupResync, match="resynchronise"):
                g.all_reduce(torch.ones(3))
            g.resync(None)
        out = [g.all_reduce(torch.full((5,), float(r + 1))), g.all_gather(torch.tensor([r]), dim=0)]
        plan = g.broadcast_ints(np.array([1, 2, 3]) if r == 0 else None)
        return out, list(plan), abandoned

    results = run_ranks(world, fn, _group(world))
    total = float(sum(range(1, world + 1)))
    for r, res in enumerate(results):
        assert not isinstance(res, Exception), f"rank {r}: {res!r}"
        (reduced, gathered), plan, _ = res
        assert reduced.tolist() == [total] * 5 and gathered.tolist() == list(range(world)) and plan == [1, 2, 3]
    assert results[0][2] < 3.0  # the peers left their waits long before the 20 s deadline


def test_resync_ends_an_idle_followers_wait_and_a_dead_peer_is_named():
    def fn(r, g, barrier):
        if r == 0:
            time.sleep(0.3)
            g.resync(5.0)
            return list(g.broadcast_ints(np.array([4, 5])))
        with pytest.raises(GroupResync):
            g.broadcast_ints(None, wait_forever=True)
        g.resync(None)
        return list(g.broadcast_ints(None, wait_forever=True))

    assert run_ranks(2, fn, _group(2)) == [[4, 5], [4, 5]]

    def dead(r, g, barrier):
        if r == 1:
            return None  # never joins
        with pytest.raises(CollectiveTimeout, match=r"resync \(join\), generation 1: ranks \[1\]"):
            g.resync(0.3)
        return "named"

    assert run_ranks(2, dead, _group(2))[0] == "named"


LATENT, HIDDEN, MAX_TOKENS, EPS = 32, 64, 8, 1e-6


def _tail(world: int, deadline_s: float = 0.5):
    name = f"rec{os.getpid()}-{time.monotonic_ns()}"

    def make(r, barrier):
        return ShmTailCollective(r, world, max_tokens=MAX_TOKENS, latent_dim=LATENT, hidden_dim=HIDDEN,
                                 dtype=torch.float32, state_alloc=lambda n, s, d: torch.zeros(s, dtype=d),
                                 group_name=name, deadline_s=deadline_s, barrier=barrier)
    return make


def _inputs(call: int, rank: int):
    g = torch.Generator().manual_seed(100 * call + rank)
    return torch.randn(3, LATENT, generator=g), torch.randn(3, HIDDEN, generator=g)


def _expected(call: int, world: int, norm, up):
    parts = [_inputs(call, r) for r in range(world)]
    routed = sum(p[0] for p in parts)
    shared = sum(p[1] for p in parts)
    return latent_norm(routed, norm, EPS) @ up.t() + shared


def test_rearm_after_lost_flags_serves_again_with_correct_bits():
    world = 2
    g = torch.Generator().manual_seed(7)
    up, norm = torch.randn(HIDDEN, LATENT, generator=g) / LATENT**0.5, torch.rand(LATENT, generator=g) + 0.5

    def fn(r, coll, barrier):
        outs = [coll.fused_tail(*_inputs(c, r), norm, up, EPS) for c in range(4)]
        coll.zero_flags()
        barrier()
        with pytest.raises(TailTimeout):
            for c in range(4, 8):  # the stale buffer is met within a few calls
                coll.fused_tail(*_inputs(c, r), norm, up, EPS)
        barrier()  # every rank out of its exchanges (recovery's resync)
        coll.rearm()
        assert coll.routed_flags.tolist() == list(INITIAL_FLAGS) == coll.shared_flags.tolist()
        barrier()  # every mailbox clean before anyone pushes
        outs += [coll.fused_tail(*_inputs(c, r), norm, up, EPS) for c in range(8, 12)]
        return outs, coll.epoch()

    results = run_ranks(world, fn, _tail(world))
    for r, res in enumerate(results):
        assert not isinstance(res, Exception), f"rank {r}: {res!r}"
    calls = list(range(4)) + list(range(8, 12))
    for i, c in enumerate(calls):
        want = _expected(c, world, norm, up)
        assert torch.equal(results[0][0][i], results[1][0][i])
        assert torch.allclose(results[0][0][i], want, rtol=1e-5, atol=1e-5), f"call {c}"
    assert results[0][1] == results[1][1] == INITIAL_FLAGS[3] + 4


def test_offline_llm_recovers_from_lost_tail_flags_without_a_restart():
    from service import LLM, SamplingParams

    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10, 11]}]
    with LLM("tiny", tensor_parallel_size=2, distributed_executor_backend="mp", dtype="float32",
             hf_overrides={"num_hidden_layers": 2}, tail_deadline_s=5.0) as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        llm.collective_rpc("zero_tail_flags")
        t0 = time.monotonic()
        failed = llm.generate(prompts[:1], greedy)[0]
        assert failed.outputs[0].finish_reason == "error"
        assert "TailTimeout" in failed.error and "re-armed on all 2 ranks" in failed.error, failed.error
        assert time.monotonic() - t0 < 60
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)] == ref
        status = llm.collective_rpc("status")
        assert [s["failed"] for s in status] == [None, None]
        assert [s["recoveries"] for s in status] == [1, 1]
        assert "TailTimeout" in status[0]["last_failure"]
        epochs = {repr(s["tail_epochs"]) for s in status}
        assert len(epochs) == 1
