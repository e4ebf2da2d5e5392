"""docs/switches.md lists every LATENTSERVE_* variable the service reads, and only those, with the
code's default: a new switch, a removed one or a changed default fails here until the doc says so."""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAME = r"LATENTSERVE_[A-Z0-9_]+"


def _source() -> str:
    return "\n".join(p.read_text() for p in sorted((ROOT / "service").rglob("*.py")))


def _documented() -> dict[str, str]:
    rows = re.findall(rf"^\| `({NAME})` \| ([^|]+) \|", (ROOT / "docs" / "switches.md").read_text(), re.M)
    return {name: default.strip() for name, default in rows}


def test_every_switch_the_service_reads_is_documented_and_none_other():
    read = set(re.findall(NAME, _source()))
    documented = _documented()
    assert sorted(read - documented.keys()) == [], "add these to docs/switches.md"
    assert sorted(documented.keys() - read) == [], "the service no longer reads these: drop them from docs/switches.md"


def test_documented_defaults_are_the_codes():
    documented = _documented()
    # os.environ.get("LATENTSERVE_X", "value"): a literal default, the doc shows it as `value`
    literal = dict(re.findall(rf"environ\.get\(\"({NAME})\", \"([^\"]*)\"\)", _source()))
    assert len(literal) > 30  # the pattern still finds the code's defaults
    for name, value in literal.items():
        want = f"`{value}`" if value else "unset"
        assert documented[name] == want, f"{name}: the code's default is {want}, docs/switches.md says {documented[name]}"
    # no default in the code: the variable is optional
    for name in re.findall(rf"environ\.get\(\"({NAME})\"\)", _source()):
        assert documented[name] == "unset", name
