"""How soon a busy Python thread hands the GIL to a waiting one, in the serving processes.

Two processes of a served step have one thread busy while another waits on it: the HTTP
process's event loop (~0.8 of a core at 256 streams) holds the GIL while the rank-0 reader
thread waits to deliver every RPC reply, and in rank 0 the engine thread holds it while the
RPC threads wait to answer add_request and the polls. Python lets a waiter in only every
switch interval (5 ms) unless the holder blocks first. At 1 ms the route's wait for rank 0 to
take a request ("admit" in the first-token split) halved and TTFT p50 fell 0.65-0.91x at 256
streams, tokens/s unchanged within the runs' noise (bench/RESULTS.md, run 92, H100).
LATENTSERVE_GIL_SWITCH_MS sets it (5: Python's own).
"""

from __future__ import annotations

import os
import sys


def hand_over_often() -> float:
    """Set this process's switch interval from LATENTSERVE_GIL_SWITCH_MS; returns the one before."""
    before = sys.getswitchinterval()
    ms = float(os.environ.get("LATENTSERVE_GIL_SWITCH_MS", "1"))
    if ms <= 0:
        raise ValueError(f"LATENTSERVE_GIL_SWITCH_MS must be positive, got {ms}")
    sys.setswitchinterval(ms / 1000)
    return before
