"""Soak, CI-sized (bench/soak.py runs 100): 20 level-2 cycles at TP 2, each discarding the
weights and loading them again from disk. Tokens identical every cycle; the rank processes'
RSS and resident shared memory flat (within 1%) from cycle 10 on."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

from soak import soak  # noqa: E402


def test_twenty_level2_cycles_with_weight_updates_keep_tokens_and_memory():
    r = soak(cycles=20, tp=2, settle=10, log=lambda msg: None)
    assert r["same_tokens"], r["tokens"]
    assert len({tuple(map(tuple, t)) for t in r["tokens"]}) == 1 and len(r["tokens"]) == 20
    assert abs(r["rss_growth"]) <= 0.01, f"rank RSS grew {r['rss_growth']:.2%} from cycle 10: {r['rss']}"
    assert abs(r["shm_growth"]) <= 0.01, f"rank shared memory grew {r['shm_growth']:.2%}: {r['shm']}"
