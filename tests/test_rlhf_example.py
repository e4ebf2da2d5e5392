"""examples/rlhf_loop.py end to end at TP 2: three cycles, one per weight transport."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_rlhf_loop_three_cycles():
    p = subprocess.run([sys.executable, str(ROOT / "examples" / "rlhf_loop.py"), "--tp", "2", "--cycles", "3"],
                       capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("cycle ")]
    assert len(lines) == 4 and all(" ok" in ln for ln in lines[1:]), p.stdout
    assert [f"weight_version={v}" in ln for v, ln in enumerate(lines)] == [True] * 4
    assert "transport=path" in lines[1] and "transport=group" in lines[2] and "transport=refs" in lines[3]
    assert "all cycles used the new weights" in p.stdout
