"""The tree stays ruff-clean, small and acyclic: CI runs this with the rest of the suite."""

import ast
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MAX_LINES = 450
# Modules allowed past MAX_LINES, and why (none today).
LONG_MODULES: dict[str, str] = {}
# Import cycles (strongly connected groups of service modules, counting imports inside functions
# too) that are known, and why (none today: the shared-memory segment that both the CPU tail and
# the TP group's collectives use lives in service/parallel/shm_segment.py). Any cycle fails.
KNOWN_CYCLES: dict[frozenset, str] = {}


def test_ruff_clean():
    ruff = shutil.which("ruff") or str(Path(sys.executable).with_name("ruff"))
    proc = subprocess.run([ruff, "check", "service", "tests", "bench", "examples"], cwd=ROOT,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_no_module_is_too_long():
    long = {str(p.relative_to(ROOT)): n for p in sorted((ROOT / "service").rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    unexplained = {p: n for p, n in long.items() if p not in LONG_MODULES}
    assert not unexplained, f"split these modules (over {MAX_LINES} lines): {unexplained}"


def import_graph() -> dict[str, set[str]]:
    """service module -> the service modules it imports (anywhere in the file)."""
    paths = {}
    for p in (ROOT / "service").rglob("*.py"):
        parts = list(p.relative_to(ROOT).with_suffix("").parts)
        paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    graph = {}
    for mod, path in paths.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(max(node.level - 1, 0)):
                    base = base.rpartition(".")[0]
                target = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
                targets = [target] + [f"{target}.{a.name}" for a in node.names]
            else:
                continue
            for t in targets:
                while t not in paths and "." in t:
                    t = t.rpartition(".")[0]
                if t in paths and t not in (mod, "service"):
                    deps.add(t)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(frozenset(group))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = import_graph()
    found = cycles(graph)
    unexplained = [sorted(c) for c in found if c not in KNOWN_CYCLES]
    assert not unexplained, f"import cycles: {unexplained}"
    # The server is started by the command line, never the other way round (the cycle that was:
    # cli -> server.app -> cli.engine_kwargs; the engine's options live in engine_config now).
    reach, todo = set(), [m for m in graph if m.startswith("service.server")]
    while todo:
        m = todo.pop()
        for d in graph[m] - reach:
            reach.add(d)
            todo.append(d)
    assert "service.cli" not in reach, "service.server imports service.cli (directly or through another module)"
