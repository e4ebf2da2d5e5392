"""Fused tail over shared memory (CPU): real rank processes, gloo for the unfused reference.

Each TP size spawns its ranks once; every rank runs all scenarios and saves what it saw, and
the tests below judge those records: fused == unfused, bit-identical outputs across ranks,
the peer table is really used, and lost flags end in TailTimeout instead of a hang.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from service.net import free_port
from service.parallel import TPGroup
from service.tail.base import TailRunner, TailTimeout, unfused_tail
from service.tail.protocol import (
    DEADLINE_ENV,
    EMPTY,
    GATHER,
    ROUTED,
    MailboxLayout,
    TailStateError,
    clear_elems,
    resolve_deadline,
)
from service.tail.shm import ShmTailCollective, segment_name

LATENT, HIDDEN, MAX_TOKENS = 96, 160, 64
M_SEQUENCE = (1, 5, 8, 16, 33, 65, 5)
DEADLINE_S = 2.0
EPS = 1e-6
pytestmark = pytest.mark.timeout(600)


def _plain_state(name, shape, dtype):
    return torch.zeros(shape, dtype=dtype)


def _inputs(seed: int, m: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    routed = torch.randn(m, LATENT, generator=g)
    shared = torch.randn(m, HIDDEN, generator=g)
    # Real negative zeros must travel as +0.0, else readers would take them for "not arrived".
    routed[0, :3] = -0.0
    shared[0, ::7] = -0.0
    return routed.to(dtype), shared.to(dtype)


def _weights(dtype: torch.dtype):
    g = torch.Generator().manual_seed(7)
    up = (torch.randn(HIDDEN, LATENT, generator=g) / LATENT**0.5).to(dtype)
    norm = (torch.rand(LATENT, generator=g) + 0.5).to(dtype)
    return up, norm


def _collective(rank, tp, name, dtype, deadline_s=DEADLINE_S):
    return ShmTailCollective(rank, tp.world_size, max_tokens=MAX_TOKENS, latent_dim=LATENT, hidden_dim=HIDDEN,
                             dtype=dtype, state_alloc=_plain_state, group_name=name, deadline_s=deadline_s,
                             barrier=tp.barrier)


def _scenario_correctness(rank, tp, tag, dtype):
    coll = _collective(rank, tp, f"{tag}-ok-{dtype}", dtype)
    up, norm = _weights(dtype)
    runner = TailRunner(3, tp, "on", coll)
    records = []
    for i, m in enumerate(M_SEQUENCE):
        routed, shared = _inputs(1000 * i + rank, m, dtype)
        ref = unfused_tail(tp, routed.clone(), shared.clone(), norm, up, EPS)
        out = runner(routed, shared, norm, up, EPS)
        records.append({"m": m, "out": out, "ref": ref, "epoch": coll.epoch()})
    too_many = None
    try:
        coll.fused_tail(*_inputs(5, MAX_TOKENS + 1, dtype), norm, up, EPS)
    except ValueError as e:
        too_many = str(e)
    result = {"records": records, "fused_calls": runner.fused_calls, "unfused_calls": runner.unfused_calls,
              "too_many": too_many, "state": coll.state()}
    coll.close()
    return result


def _scenario_zeroed_table(rank, tp, tag):
    coll = _collective(rank, tp, f"{tag}-tbl0", torch.float32)
    up, norm = _weights(torch.float32)
    coll.fused_tail(*_inputs(1, 2, torch.float32), norm, up, EPS)
    coll.peer_ptrs.zero_()
    try:
        coll.fused_tail(*_inputs(2, 2, torch.float32), norm, up, EPS)
        err = None
    except TailStateError as e:
        err = str(e)
    coll.close()
    return err


def _scenario_swapped_table(rank, tp, tag):
    """Rank 0 swaps two peers' rows: its stores go elsewhere, so the result must change."""
    coll = _collective(rank, tp, f"{tag}-swap", torch.float32)
    up, norm = _weights(torch.float32)
    routed, shared = _inputs(3 + rank, 4, torch.float32)
    ref = unfused_tail(tp, routed.clone(), shared.clone(), norm, up, EPS)
    if rank == 0:
        a, b = (0, 1) if tp.world_size == 2 else (1, 2)
        coll.peer_ptrs[[a, b]] = coll.peer_ptrs[[b, a]].clone()
    tp.barrier()
    try:
        out = coll.fused_tail(routed, shared, norm, up, EPS)
        changed = not torch.allclose(out, ref, rtol=1e-4, atol=1e-4)
    except TailTimeout:
        changed = True
    tp.barrier()
    coll.close()
    return changed


def _scenario_lost_flags(rank, tp, tag):
    """The seed's negative control: flags zeroed on every rank after some good calls."""
    coll = _collective(rank, tp, f"{tag}-lost", torch.float32)
    up, norm = _weights(torch.float32)
    # Zero the flags at different points of the buffer cycle for TP 2 and 4, so the stale
    # buffer is met at the third and at the second call after the loss.
    good_calls = 3 if tp.world_size == 2 else 5
    good_before = 0
    for i in range(good_calls):
        routed, shared = _inputs(50 + i * 10 + rank, 3, torch.float32)
        ref = unfused_tail(tp, routed.clone(), shared.clone(), norm, up, EPS)
        good_before += torch.allclose(coll.fused_tail(routed, shared, norm, up, EPS), ref, rtol=1e-5, atol=1e-5)
    coll.zero_flags()
    tp.barrier()
    calls, outcome = [], None
    for i in range(5):
        routed, shared = _inputs(90 + i * 10 + rank, 3, torch.float32)
        ref = unfused_tail(tp, routed.clone(), shared.clone(), norm, up, EPS)
        t0 = time.perf_counter()
        try:
            out = coll.fused_tail(routed, shared, norm, up, EPS)
        except TailTimeout as e:
            outcome = {"call": i + 1, "seconds": time.perf_counter() - t0, "message": str(e)}
            break
        calls.append(bool(torch.allclose(out, ref, rtol=1e-5, atol=1e-5)))
    coll.close()
    return {"good_before": good_before, "good_calls": good_calls, "calls_ok": calls, "timeout": outcome}


def _worker(rank, world_size, port, out_dir, tag):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    tp = TPGroup(rank, world_size, dist.group.WORLD)
    result = {}
    try:
        result["fp32"] = _scenario_correctness(rank, tp, tag, torch.float32)
        result["bf16"] = _scenario_correctness(rank, tp, tag, torch.bfloat16)
        result["zeroed_table"] = _scenario_zeroed_table(rank, tp, tag)
        tp.barrier()
        result["swapped_table"] = _scenario_swapped_table(rank, tp, tag)
        result["lost_flags"] = _scenario_lost_flags(rank, tp, tag)
    except Exception:
        result["error"] = traceback.format_exc()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    dist.destroy_process_group()


@pytest.fixture(scope="module", params=[2, 4], ids=lambda tp: f"tp{tp}")
def ranks(request, tmp_path_factory):
    tp = request.param
    out = tmp_path_factory.mktemp(f"tail_tp{tp}")
    tag = f"test{os.getpid()}-{tp}"
    ctx = mp.start_processes(_worker, args=(tp, free_port(), str(out), tag), nprocs=tp, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + 400
    try:
        while not ctx.join(timeout=5):
            if time.monotonic() > deadline:
                pytest.fail(f"TP {tp} ranks still running after 400 s: a fused tail hung")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(tp)]
    for r, res in enumerate(results):
        assert "error" not in res, f"rank {r}:\n{res['error']}"
    return results


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


@pytest.mark.parametrize("dtype,tol", [("fp32", 2e-6), ("bf16", 2e-2)])
def test_fused_matches_unfused(ranks, dtype, tol):
    for res in ranks:
        recs = res[dtype]["records"]
        assert [r["m"] for r in recs] == list(M_SEQUENCE)
        for rec in recs:
            assert rec["out"].dtype == rec["ref"].dtype and rec["out"].shape == (rec["m"], HIDDEN)
            err = _rel_err(rec["out"], rec["ref"])
            assert err <= tol, f"M={rec['m']}: max error {err:.2e} relative to the output's max"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_outputs_bit_identical_across_ranks(ranks, dtype):
    for r, res in enumerate(ranks[1:], start=1):
        for rec0, rec in zip(ranks[0][dtype]["records"], res[dtype]["records"]):
            if rec["m"] <= MAX_TOKENS:  # the unfused fallback is gloo's business
                assert torch.equal(rec0["out"], rec["out"]), f"rank {r} differs at M={rec['m']}"


def test_runner_falls_back_above_max_tokens(ranks):
    res = ranks[0]["fp32"]
    assert res["unfused_calls"] == sum(m > MAX_TOKENS for m in M_SEQUENCE)
    assert res["fused_calls"] == sum(m <= MAX_TOKENS for m in M_SEQUENCE)
    assert "1..64" in res["too_many"]
    # One epoch per fused call, starting at 1, the same on every rank.
    epochs = [[rec["epoch"] for rec in r["fp32"]["records"]] for r in ranks]
    assert all(e == epochs[0] for e in epochs)
    assert epochs[0][-1] == 1 + res["fused_calls"]


def test_zeroed_peer_table_is_an_error(ranks):
    for r, res in enumerate(ranks):
        assert res["zeroed_table"] is not None, f"rank {r} ran with a zeroed peer table"
        assert "peer_ptrs" in res["zeroed_table"] and "no mapped tail segment" in res["zeroed_table"]


def test_swapped_peer_table_changes_the_result(ranks):
    assert any(res["swapped_table"] for res in ranks)


def test_lost_flags_end_in_timeout_not_hang_or_garbage(ranks):
    calls = set()
    for r, res in enumerate(ranks):
        lost = res["lost_flags"]
        assert lost["good_before"] == lost["good_calls"]
        assert all(lost["calls_ok"]), f"rank {r}: a call after the flags were lost returned wrong data"
        t = lost["timeout"]
        assert t is not None, f"rank {r}: no TailTimeout after zeroing the flags"
        assert t["call"] <= 3
        assert t["seconds"] < DEADLINE_S + 5
        assert f"rank {r}" in t["message"] and "epoch" in t["message"] and "buffer" in t["message"]
        calls.add(t["call"])
    assert len(calls) == 1, f"ranks timed out at different calls: {calls}"


# ---- single-process checks of the protocol's pieces --------------------------------------

def test_adding_zero_clears_negative_zero_only():
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.tensor([-0.0, 0.0, -1.5, float("inf"), -3e-39], dtype=dtype)
        y = torch.empty_like(x)
        torch.add(x, 0.0, out=y)
        assert not torch.signbit(y[0]) and torch.equal(y[1:], x[1:])


def test_layout_keeps_exchanges_apart():
    lay = MailboxLayout(4, 64, LATENT, HIDDEN, 2)
    ends = []
    for ex in range(3):
        assert lay.tags_offset(ex) >= lay.payload_offset(ex) + lay.payload_bytes(ex)
        ends.append((lay.payload_offset(ex), lay.tags_offset(ex) + lay.tags_bytes()))
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))
    assert lay.total_bytes >= ends[-1][1] and lay.width(ROUTED) == LATENT and lay.width(GATHER) == HIDDEN // 4
    assert clear_elems(10**9, lay, ROUTED) == 64 * LATENT  # corrupt byte counts cannot overrun a slot
    assert clear_elems(-5, lay, ROUTED) == 0 and EMPTY == 0
    with pytest.raises(ValueError):
        MailboxLayout(3, 64, LATENT, HIDDEN, 2)


def test_deadline_env_overrides(monkeypatch):
    assert resolve_deadline(10.0) == 10.0
    monkeypatch.setenv(DEADLINE_ENV, "0.5")
    assert resolve_deadline(10.0) == 0.5


def rms_norm_ref(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS)


def test_stale_segment_recreated_and_names_unlinked_once_mapped():
    name = f"close{os.getpid()}"
    colls = []
    # Two ranks as threads of one process, synchronised like TPGroup.barrier would.
    own_paths = [os.path.join("/dev/shm", segment_name(name, r)) for r in range(2)]
    with open(own_paths[0], "wb") as f:  # a crashed run's leftover, of the wrong size
        f.write(b"junk")
    from threading import Barrier, Thread
    barrier = Barrier(2)

    def make(r):
        colls.append(ShmTailCollective(r, 2, max_tokens=4, latent_dim=8, hidden_dim=8, dtype=torch.float32,
                                       state_alloc=_plain_state, group_name=name, barrier=barrier.wait))

    threads = [Thread(target=make, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    # Both ranks came up despite the junk file, and the names are gone once everyone mapped them.
    assert len(colls) == 2 and not any(os.path.exists(p) for p in own_paths)
    bases = [c.peer_ptrs[:, 0].tolist() for c in colls]
    assert bases[0] != bases[1]  # each rank has its own mapping of both segments
    colls.sort(key=lambda c: c.rank)
    up, norm = torch.eye(8), torch.ones(8)
    x = [torch.arange(8.0).view(1, 8) + r for r in range(2)]
    outs = [None, None]

    def call(r):
        outs[r] = colls[r].fused_tail(x[r], x[r], norm, up, EPS)

    threads = [Thread(target=call, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    shared = x[0] + x[1]
    assert torch.equal(outs[0], outs[1]) and torch.allclose(outs[0], rms_norm_ref(shared) + shared)
    for c in colls:
        c.close()
