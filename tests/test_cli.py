"""The CLI as users run it: `latentserve generate`, with clear errors and exit codes."""

import json
import subprocess
import sys

LS = [sys.executable, "-m", "service.cli"]


def _run(*args, timeout=240):
    return subprocess.run([*LS, *args], capture_output=True, text=True, timeout=timeout)


def test_generate_tp2_text_and_token_ids():
    p = _run("generate", "--model", "tiny", "--tp", "2", "--prompt", "Hello there", "--prompt-token-ids",
             "5,6,7", "--max-tokens", "8", "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert len(rows) == 2
    assert all(len(r["token_ids"]) == 8 or r["finish_reason"] == "stop" for r in rows)
    assert isinstance(rows[0]["text"], str)


def test_bad_tp_exits_2_with_reason():
    p = _run("generate", "--model", "tiny", "--tp", "3", "--prompt", "x")
    assert p.returncode == 2
    assert "does not divide" in p.stderr


def test_missing_model_exits_2():
    p = _run("generate", "--model", "/nonexistent/ckpt", "--prompt", "x")
    assert p.returncode == 2
    assert "neither a preset" in p.stderr


def test_bad_block_size_exits_2_with_reason():
    p = _run("generate", "--model", "tiny", "--block-size", "24", "--prompt", "x")
    assert p.returncode == 2
    assert "block_size must be a power of 2" in p.stderr


def test_generate_without_ray_mp_tp2_matches_uni_tp1():
    # The mp run also keeps its KV cache in blocks of 32 slots (--block-size): the same tokens.
    common = ("generate", "--model", "tiny", "--dtype", "float32", "--prompt-token-ids", "5,6,7,8",
              "--max-tokens", "8", "--json")
    outs = {}
    for backend, tp, extra in (("uni", "1", ()), ("mp", "2", ("--block-size", "32"))):
        p = _run(*common, "--tp", tp, "--distributed-executor-backend", backend, *extra)
        assert p.returncode == 0, p.stderr[-2000:]
        outs[backend] = [json.loads(line)["token_ids"] for line in p.stdout.splitlines() if line.startswith("{")]
    assert outs["mp"] == outs["uni"] and len(outs["uni"][0]) == 8
