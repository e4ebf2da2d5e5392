"""Fuzzing the served API with schemathesis (tests/test_server_fuzz.py in CI, bench/fuzz.py for more).

Every operation of the served `/openapi.json` gets generated requests, valid and invalid
(schemathesis' positive and negative modes), admin ones with the key. A response passes when:

- it is not a server error, except 503 / 504 (a state or deadline answer) and the documented
  model-execution error (500 with code `engine_error`);
- an error status (>= 400) carries OpenAI's body: `{"error": {"message", "type", "param", "code"}}`
  with a string message and type.

Operations run in an order that keeps the service useful for the next ones: generation first,
then read-only admin calls, then weight updates, then the state changes (pause, sleep, wake),
restart last. `settle()` then wakes and resumes the service.
"""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import httpx

ORDER = ["/v1/models", "/v1/completions", "/v1/chat/completions", "/health", "/metrics", "/is_sleeping",
         "/v1/status", "/collective_rpc", "/update_weights", "/pause", "/resume", "/sleep", "/wake_up", "/restart"]
OK_5XX = (503, 504)  # a state the service is in (asleep, paused, restarting) or a missed deadline
DOCUMENTED_500 = "engine_error"  # the model's forward failed (docs/api.md)


@dataclass
class Report:
    statuses: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    problems: list[dict] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def cases(self) -> int:
        return sum(sum(c.values()) for c in self.statuses.values())

    def summary(self) -> str:
        lines = [f"{self.cases} requests, {len(self.problems)} problems"]
        for label, counts in self.statuses.items():
            lines.append(f"  {label:<28} {self.seconds.get(label, 0):6.1f}s  "
                         + " ".join(f"{s}x{n}" for s, n in sorted(counts.items())))
        for p in self.problems[:20]:
            lines.append(f"  PROBLEM {p['operation']}: {p['problem']}\n    {p['request'][:400]}")
        return "\n".join(lines)


def problem(path: str, status: int, body: bytes, content_type: str) -> str | None:
    """Why this response breaks the rules above (None: it does not)."""
    if status < 400:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return f"HTTP {status} with a body that is not JSON ({content_type}): {body[:200]!r}"
    err = data.get("error") if isinstance(data, dict) else None
    shaped = (isinstance(err, dict) and {"message", "type", "param", "code"} <= set(err)
              and isinstance(err["message"], str) and isinstance(err["type"], str))
    if not shaped:
        return f"HTTP {status} without an OpenAI-shaped error body: {str(data)[:300]}"
    if status >= 500 and status not in OK_5XX and not (status == 500 and err.get("code") == DOCUMENTED_500):
        return f"HTTP {status} ({err.get('code')}): {err['message'][:300]}"
    return None


def _sort_key(op) -> tuple[int, str]:
    return (ORDER.index(op.path) if op.path in ORDER else len(ORDER), op.method)


def fuzz(url: str, admin_key: str, max_examples: int = 10, seed: int = 0, exclude: tuple[str, ...] = (),
         only: tuple[str, ...] = (), request_timeout: float = 60.0, restart_examples: int = 1,
         log=print) -> Report:
    """Run the generated requests against the service at `url`; never raises on a bad response."""
    import schemathesis
    from schemathesis import GenerationMode

    schema = schemathesis.openapi.from_url(url + "/openapi.json")
    ops = sorted((r.ok() for r in schema.get_all_operations()), key=_sort_key)
    headers = {"Authorization": f"Bearer {admin_key}"}
    report = Report()
    for op in ops:
        if op.path in exclude or (only and op.path not in only):
            continue
        label = f"{op.method.upper()} {op.path}"
        n = restart_examples if op.path == "/restart" else max_examples
        t0 = time.monotonic()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _run_mode(op, mode, url, headers, label, n, seed, request_timeout, report)
        report.seconds[label] = time.monotonic() - t0
        log(f"  {label}: {dict(report.statuses[label])} in {report.seconds[label]:.1f}s")
    return report


def _run_mode(op, mode, url: str, headers: dict, label: str, n: int, seed: int, request_timeout: float,
              report: Report) -> None:
    import hypothesis
    from hypothesis import HealthCheck, Phase, given, settings

    @settings(max_examples=n, deadline=None, database=None, print_blob=False,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @hypothesis.seed(seed)
    @given(case=op.as_strategy(generation_mode=mode))
    def run(case):
        try:
            response = case.call(base_url=url, headers=headers, timeout=request_timeout)
        except Exception as e:  # a hung or dropped request is a finding too
            report.problems.append({"operation": label, "problem": f"no answer: {type(e).__name__}: {e}",
                                    "request": case.as_curl_command(headers=headers)})
            report.statuses[label]["none"] += 1
            return
        report.statuses[label][response.status_code] += 1
        why = problem(op.path, response.status_code, response.content, response.headers.get("content-type", ""))
        if why:
            report.problems.append({"operation": label, "problem": why,
                                    "request": case.as_curl_command(headers=headers)})

    try:
        run()
    except hypothesis.errors.Unsatisfiable:  # no invalid input exists (an operation without parameters)
        pass


def settle(url: str, admin_key: str, timeout: float = 120.0) -> dict:
    """Wake and resume the service after fuzzing; returns /health's body once it answers 200."""
    headers = {"Authorization": f"Bearer {admin_key}"}
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=url, headers=headers, timeout=60.0) as c:
        while True:
            c.post("/wake_up")
            c.post("/resume")
            h = c.get("/health")
            state = c.get("/is_sleeping").json()
            if h.status_code == 200 and not state.get("is_sleeping") and h.json().get("state") == "running":
                return h.json()
            if time.monotonic() > deadline:
                raise AssertionError(f"not healthy and running after fuzzing: {h.status_code} {h.text} {state}")
            time.sleep(1.0)
