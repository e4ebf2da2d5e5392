"""Recovery in place after a failed step: every rank realigns the TP group and re-arms its fused tail.

A step that fails on any rank (a `TailTimeout`, a collective that timed out, an exception in the
model) leaves the ranks stopped at different points: some inside a collective, some out of the
step, the fused tail's mailboxes holding unconsumed data and its flags out of step. Every rank
whose step fails calls `recover()`; a peer's request ends the other ranks' pending waits
(`GroupResync`), so they call it too. Then, on every rank:

1. `ShmGroup.resync`: all ranks out of their step, op counters agreed, the step plans' block
   table deltas forgotten (`PlanCodec.reset`);
2. the fused tail re-armed: own mailboxes refilled with sentinels and EMPTY tags, flags back to
   their initial values (the same epochs everywhere), the peer table as built;
3. a barrier (no rank starts an exchange before every mailbox is clean), then one all-gather of
   each rank's flags and error, so rank 0 checks the agreement and names the failing rank.

Rank 0 runs it inside the failed step, so the engine's next step (the requests queued behind
the failed ones) runs on a re-armed tail. Only when this fails (a peer dead or stuck past the
deadline) is the rank marked failed: then it takes `POST /restart`.
"""

from __future__ import annotations

import time

import torch

from ..log import get_logger
from ..parallel.shm_group import GroupResync

log = get_logger("recovery")

_REASON_BYTES = 1024
# Beyond the tail's own deadline: a peer finishing (or failing) the layer it is in.
_JOIN_MARGIN_S = 30.0


class RankStepFailed(RuntimeError):
    """Another rank's step failed; this rank's part of it was abandoned. The message is the peer's."""


class RecoveryFailed(RuntimeError):
    """The ranks could not be realigned: the model needs a restart."""


def join_deadline(worker) -> float | None:
    """Rank 0 waits for the others this long (they leave a failed step within the tail deadline);
    the others wait for rank 0 as long as it takes (it joins at its next step at the latest)."""
    if worker.rank != 0:
        return None
    tail = worker.collective.deadline_s if worker.collective is not None else worker.config.tail_deadline_s
    return float(tail) + _JOIN_MARGIN_S


def recover(worker, error: BaseException | None) -> BaseException | None:
    """Realign every rank after `error` (None: a peer asked, nothing failed here). Returns the
    exception the failed step should raise on this rank; sets `worker.failed` if recovery fails."""
    own = error is not None and not isinstance(error, GroupResync)
    text = f"{type(error).__name__}: {error}" if own else ""
    if own:
        worker.last_failure = text
        log.error("step_failed", rank=worker.rank, error=text)
    shm = worker.tp.shm
    if worker.world_size == 1 or shm is None:
        # One rank, or ranks over gloo (several nodes, no fused tail): no shared state to re-arm.
        return error
    t0 = time.perf_counter()
    try:
        shm.resync(join_deadline(worker))
        # A message broadcast before the resync may be dropped unread: no rank assumes the
        # others hold the last step's block tables (plan deltas) any more.
        worker.plan_codec.reset()
        with worker._exec_lock:
            if worker.collective is not None and worker._flags_readable():
                worker.collective.rearm()
            if worker.tp.device_comm is not None and worker._flags_readable():
                worker.tp.device_comm.rearm()  # the device all-reduce's mailboxes and flags, alike
        worker.tp.barrier()  # nobody pushes into a mailbox its owner has not cleared yet
        flags, reasons = _exchange_reports(worker, text)
    except Exception as e:  # a peer dead or stuck: only a restart helps now
        worker.failed = (f"{text or 'a peer rank failed its step'}; re-arming the TP group and fused tail "
                         f"failed: {type(e).__name__}: {e}")
        log.error("recovery_failed", rank=worker.rank, error=worker.failed)
        return error if own else RecoveryFailed(worker.failed)
    if len({tuple(f) for f in flags}) > 1:
        worker.failed = f"ranks disagree on the re-armed fused-tail flags: {flags}"
        log.error("recovery_failed", rank=worker.rank, error=worker.failed)
        return RecoveryFailed(worker.failed)
    worker.recoveries += 1
    seconds = round(time.perf_counter() - t0, 3)
    failing = [r for r, why in enumerate(reasons) if why]
    log.warning("rearmed", rank=worker.rank, recoveries=worker.recoveries, failing_ranks=failing, seconds=seconds)
    note = (f" [the step's requests failed; ranks {failing} failed it; the TP group and fused tail were "
            f"re-armed on all {worker.world_size} ranks in {seconds:g}s and serving goes on]")
    if own:
        _append(error, note)
        return error
    if error is None:
        return None
    first = failing[0] if failing else None
    why = reasons[first] if first is not None else "no rank reported an error"
    return RankStepFailed(f"rank {first} failed the step: {why}{note}")


def _exchange_reports(worker, text: str) -> tuple[list[list[int]], list[str]]:
    """Every rank's flags (routed, shared) and step error, in rank order."""
    coll = worker.collective
    if coll is not None and worker._flags_readable():
        flags = torch.cat([coll.routed_flags, coll.shared_flags]).to("cpu", torch.int64)
    else:
        flags = torch.full((8,), -1, dtype=torch.int64)
    raw = text.encode()[:_REASON_BYTES]
    reason = torch.zeros(_REASON_BYTES, dtype=torch.uint8)
    reason[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else reason[:0]
    tp, n = worker.tp, worker.world_size
    all_flags = tp.all_gather(flags, dim=0).view(n, -1).tolist()
    all_reasons = tp.all_gather(reason, dim=0).view(n, -1)
    texts = [bytes(r.tolist()).rstrip(b"\0").decode(errors="replace") for r in all_reasons]
    return all_flags, texts


def _append(error: BaseException, note: str) -> None:
    """Add the recovery note to the error's message (the engine reports `type: message`)."""
    if len(error.args) == 1 and isinstance(error.args[0], str):
        error.args = (error.args[0] + note,)
