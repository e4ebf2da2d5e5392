"""The weight-sync group on its own (one thread per member): buckets arrive intact, members leave
together, and a member that gives up ends the others' wait with its reason instead of a timeout."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from service.net import free_port
from service.weights.sync import SyncGroup, describe

RANKS = 2
TIMEOUT_S = 60.0


def run_group(named: dict, bucket_bytes: int, on_tensor=None) -> tuple[dict, dict]:
    """The trainer (this thread) sends `named` to RANKS receivers; returns (received, errors) by rank,
    errors including the trainer's (rank 0). on_tensor(rank, tensors received so far) after each."""
    port, metas = free_port("127.0.0.1"), describe(named.items())
    received: dict = {r: {} for r in range(1, RANKS + 1)}
    errors: dict = {}

    def rank(r: int) -> None:
        group = SyncGroup("127.0.0.1", port, r, RANKS + 1, timeout_s=TIMEOUT_S)
        try:
            for name, t in group.receive(metas, bucket_bytes):
                received[r][name] = t.clone()
                if on_tensor is not None:
                    on_tensor(r, len(received[r]))
        except Exception as e:
            errors[r] = e
            group.abandon(f"rank {r} gave up: {e}")
        finally:
            group.close()

    threads = [threading.Thread(target=rank, args=(r,), daemon=True) for r in range(1, RANKS + 1)]
    for t in threads:
        t.start()
    trainer = SyncGroup("127.0.0.1", port, 0, RANKS + 1, timeout_s=TIMEOUT_S)
    try:
        trainer.send(named, metas, bucket_bytes)
    except Exception as e:
        errors[0] = e
        trainer.abandon(str(e))
    for t in threads:
        t.join(TIMEOUT_S)
        assert not t.is_alive(), "a rank is still in the group"
    trainer.close()
    return received, errors


def test_every_rank_receives_every_bucket_and_all_leave_cleanly():
    g = torch.Generator().manual_seed(0)
    named = {"a": torch.randn(300, 257, generator=g), "b": torch.randn(64, generator=g).to(torch.bfloat16),
             "c": torch.randn(3, 5, 7, generator=g)}
    for _ in range(3):  # back to back: a member that left early would fail a later round or this one
        received, errors = run_group(named, bucket_bytes=128 << 10)
        assert errors == {}
        for r in range(1, RANKS + 1):
            assert set(received[r]) == set(named)
            for name, t in named.items():
                assert received[r][name].dtype == t.dtype and torch.equal(received[r][name], t)


def test_a_rank_that_gives_up_after_its_last_bucket_fails_the_sync_with_its_reason():
    named = {"w": torch.ones(128, 128), "v": torch.zeros(10)}

    def fail_rank_1(r: int, count: int) -> None:
        if r == 1 and count == len(named):
            raise ValueError("shape check failed on load")

    received, errors = run_group(named, bucket_bytes=1 << 20, on_tensor=fail_rank_1)
    assert isinstance(errors[1], ValueError)
    for member in (0, 2):  # the trainer and the other rank hear why, not a timeout
        assert isinstance(errors[member], RuntimeError), errors
        assert "rank" in str(errors[member]) and "shape check failed on load" in str(errors[member])


@pytest.mark.parametrize("bucket_bytes", [1, 4096])
def test_bucketing_keeps_tensor_boundaries(bucket_bytes):
    named = {f"t{i}": torch.full((i + 1, 3), float(i)) for i in range(5)}
    received, errors = run_group(named, bucket_bytes)
    assert errors == {} and all(torch.equal(received[1][n], t) for n, t in named.items())


def test_a_rank_that_fails_mid_sync_fails_every_member_without_a_hang():
    """A rank that fails on its first tensor, with buckets still to come: the trainer's next
    broadcast meets a closed group, so every member ends with an error, none waits out a timeout."""
    named = {f"t{i}": torch.full((256, 256), float(i)) for i in range(6)}  # 256 KB each, a bucket each

    def fail_rank_1(r: int, count: int) -> None:
        if r == 1:
            raise ValueError(f"rank 1 cannot load tensor {count}")

    t0 = time.monotonic()
    _, errors = run_group(named, bucket_bytes=256 << 10, on_tensor=fail_rank_1)
    assert isinstance(errors[1], ValueError) and set(errors) == {0, 1, 2}, errors
    assert time.monotonic() - t0 < TIMEOUT_S / 2, "a member waited out a timeout"
