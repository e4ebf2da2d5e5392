"""docs/benchmarks.md names every script in bench/ (a row of its own, or inside the row of the
script that runs it) and every mode of bench/gpu_check.sh: a new benchmark fails here until the
page says what it measures."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = (ROOT / "docs" / "benchmarks.md").read_text()


def test_every_bench_script_is_named():
    named = set(re.findall(r"`(bench/[a-z0-9_]+\.(?:py|sh))`", PAGE))
    scripts = {f"bench/{p.name}" for p in (ROOT / "bench").iterdir() if p.suffix in (".py", ".sh")}
    assert sorted(scripts - named) == [], "say what these measure in docs/benchmarks.md"
    assert sorted(named - scripts) == [], "these scripts are gone: drop them from docs/benchmarks.md"


def test_every_gpu_check_mode_is_named():
    source = (ROOT / "bench" / "gpu_check.sh").read_text()
    modes = set(re.findall(r'"\$what" = ([a-z0-9_]+) \]', source))
    assert len(modes) > 15  # the pattern still finds the script's modes
    row = next(line for line in PAGE.splitlines() if line.startswith("| `bench/gpu_check.sh`"))
    assert sorted(m for m in modes if not re.search(rf"`{m}[` ]", row)) == [], "name these modes in gpu_check.sh's row"
