"""bench/gpu.py's `critical_path`: what each kernel of a PDL replay costs the step. Profiled
kernels overlap under PDL (a kernel starts early and waits), so their durations do not add up;
exposed times plus idle gaps must add up to the replay's span, whatever the overlap."""

import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

from gpu import critical_path  # noqa: E402


def kernel(name: str, start: float, end: float) -> SimpleNamespace:
    return SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end))


def test_overlap_gap_and_a_kernel_inside_another():
    events = [
        kernel("gemv", 0, 10),
        kernel("mla", 4, 16),     # started early under PDL: costs only its 6 us past gemv's end
        kernel("merge", 5, 12),   # wholly inside mla's span: costs nothing
        kernel("gemv", 20, 23),   # after 4 us with nothing running
    ]
    exposed, idle = critical_path(list(reversed(events)))  # the profiler's order is not the start order
    assert exposed == {"gemv": 13.0, "mla": 6.0, "merge": 0.0}
    assert idle == 4.0
    assert sum(exposed.values()) + idle == 23  # the span: first start 0 to last end 23


def test_serial_kernels_cost_their_durations():
    exposed, idle = critical_path([kernel("a", 0, 2), kernel("b", 3, 7), kernel("a", 7, 8)])
    assert exposed == {"a": 3.0, "b": 4.0} and idle == 1.0
