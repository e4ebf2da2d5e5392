"""Ranks as threads of one process, for the shared-memory collectives' tests."""

from __future__ import annotations

import threading


def run_ranks(world: int, fn, make, timeout: float = 60.0) -> list:
    """fn(rank, obj, barrier) on `world` thread ranks, obj = make(rank, barrier); results or exceptions."""
    barrier = threading.Barrier(world)
    results: list = [None] * world

    def rank(r: int) -> None:
        obj = make(r, barrier.wait)
        try:
            results[r] = fn(r, obj, barrier.wait)
        except Exception as e:  # noqa: BLE001 - handed to the test
            results[r] = e
        finally:
            obj.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    return results
