"""Fuzz the served API with schemathesis, more than CI does (tests/test_server_fuzz.py).

    python bench/fuzz.py                       # a TP-2 tiny server of its own, 200 examples per operation
    python bench/fuzz.py --examples 1000 --seeds 3
    python bench/fuzz.py --url http://HOST:PORT --admin-key KEY   # a running service (it is left awake)

Every operation of /openapi.json, valid and invalid requests, admin ones with the key (tests/api_fuzz.py
says what passes). Exits 1 on any problem, or when the service is not healthy afterwards or its greedy
tokens changed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [REPO, os.path.join(REPO, "tests")]

from api_fuzz import fuzz, settle  # noqa: E402

from service.client import Client  # noqa: E402
from service.server.launch import start_healthy  # noqa: E402

SERVE_ARGS = ["--model", "tiny", "--tp", "2", "--max-model-len", "64", "--max-num-seqs", "8", "--request-timeout-s",
              "20", "--enable-sleep-mode", "--sleep-preserve-parameter-names", "*", "--weight-snapshot", "host"]
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


def tokens(c: Client) -> list[list[int]]:
    r = c.completions(PROMPTS, max_tokens=6, temperature=0.0, ignore_eos=True)
    return [ch["token_ids"] for ch in sorted(r["choices"], key=lambda ch: ch["index"])]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url")
    p.add_argument("--admin-key", default=os.environ.get("LATENTSERVE_ADMIN_KEY"))
    p.add_argument("--examples", type=int, default=200, help="per operation and generation mode")
    p.add_argument("--seeds", type=int, default=1, help="rounds, each with its own seed")
    p.add_argument("--no-restart", action="store_true", help="leave POST /restart out")
    args = p.parse_args()
    server = None
    url, key = args.url, args.admin_key
    if url is None:
        server, startup = start_healthy(SERVE_ARGS)
        url, key = server.url, server.admin_key
        print(f"server healthy after {startup:.1f}s (log {server.log_path})")
    elif not key:
        p.error("--url needs --admin-key (or LATENTSERVE_ADMIN_KEY)")
    ok = True
    try:
        with Client(url, key, timeout=120) as c:
            before = tokens(c)
            for seed in range(args.seeds):
                t0 = time.monotonic()
                report = fuzz(url, key, max_examples=args.examples, seed=seed,
                              exclude=("/restart",) if args.no_restart else ())
                print(f"seed {seed}: {time.monotonic() - t0:.1f}s\n{report.summary()}")
                ok &= not report.problems
                health = settle(url, key)
                same = tokens(c) == before
                print(f"afterwards: /health {health}, greedy tokens {'unchanged' if same else 'CHANGED'}")
                ok &= same
    finally:
        if server is not None:
            server.stop()
    print("RESULT:", "PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
