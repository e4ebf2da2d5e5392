"""Acceptance: schemathesis against the served /openapi.json of a TP-2 server, every operation (admin
ones with the key), valid and invalid requests, a bounded number each: no server error except the
documented model-execution one, every error body OpenAI-shaped, and the service healthy afterwards
with the greedy tokens of before. bench/fuzz.py runs the same with more examples."""

from __future__ import annotations

import time

import pytest
from api_fuzz import fuzz, settle

from service.client import Client

pytest.importorskip("schemathesis")
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]
# Bounded work per request (short contexts, few sequences, a request deadline) and every
# parameter kept by level-2 sleeps, so a fuzzed sleep cannot change what the model serves.
SERVE_ARGS = ("--max-model-len", "64", "--max-num-seqs", "8", "--request-timeout-s", "20", "--enable-sleep-mode",
              "--sleep-preserve-parameter-names", "*", "--weight-snapshot", "host")


def _tokens(c: Client) -> list[list[int]]:
    r = c.completions(PROMPTS, max_tokens=6, temperature=0.0, ignore_eos=True)
    return [ch["token_ids"] for ch in sorted(r["choices"], key=lambda ch: ch["index"])]


def test_fuzzed_api_answers_in_openai_shape_and_stays_healthy(server_factory):
    server = server_factory(*SERVE_ARGS)
    with Client(server.url, server.admin_key, timeout=120) as c:
        before = _tokens(c)
        t0 = time.monotonic()
        report = fuzz(server.url, server.admin_key, max_examples=25, seed=14)
        print(f"\nfuzz: {time.monotonic() - t0:.1f}s\n{report.summary()}")
        assert not report.problems, report.summary()
        assert report.cases > 250 and len(report.statuses) == 14  # every operation was called
        assert settle(server.url, server.admin_key)["status"] == "ok"
        assert _tokens(c) == before
