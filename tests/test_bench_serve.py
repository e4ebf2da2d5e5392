"""bench/serve.py: its options, the CUDA-only path's refusal on a machine without CUDA, the serve
options of the CUDA run (parsed by `latentserve serve` as the offline baseline parses them), the
summary arithmetic, and one short CPU run through the mp executor with clients in two processes
and the offline baseline."""

import json
import os
import subprocess
import sys

import pytest
import torch

from service.cli import build_parser
from service.engine_config import EngineConfig, engine_kwargs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench", "serve.py")
sys.path.insert(0, os.path.join(ROOT, "bench"))

import serve as bench  # noqa: E402


def run_bench(*argv: str, timeout: float = 120.0) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, BENCH, *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_help_lists_the_device_option():
    r = run_bench("--help")
    assert r.returncode == 0
    for option in ("--device", "--clients", "--offline", "--client-procs", "--layers"):
        assert option in r.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_is_a_clear_usage_error():
    r = run_bench("--device", "cuda")
    assert r.returncode == 2
    assert "--device cuda needs a CUDA GPU" in r.stderr and "torch.cuda.is_available() is False" in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_options_are_usage_errors():
    assert run_bench("--clients", "8,x").returncode == 2
    assert run_bench("--clients", "0").returncode == 2
    r = run_bench("--url", "http://10.0.0.1:8000")
    assert r.returncode == 2 and "loopback" in r.stderr
    r = run_bench("--url", "http://127.0.0.1:8000", "--offline")
    assert r.returncode == 2 and "--offline" in r.stderr


def test_graph_sizes_cover_every_level():
    assert bench.graph_sizes(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert bench.graph_sizes(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert bench.graph_sizes(1) == [1]
    assert bench.split(256, 4) == [64, 64, 64, 64]
    assert bench.split(6, 4) == [2, 2, 1, 1]
    assert bench.split(2, 4) == [1, 1]


def test_cuda_defaults_make_the_serve_options_of_the_h200_run(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    args = bench.parse_args(["--device", "cuda"])
    assert args.clients == [64, 256] and args.offline and args.cycles == 0 and args.requests == 0
    ns = build_parser().parse_args(["serve", *bench.server_args(args)])
    assert ns.distributed_executor_backend == "mp" and ns.tp == 1
    cfg = EngineConfig(**engine_kwargs(ns)).resolve()
    assert cfg.device == "cuda" and cfg.dtype == "bfloat16" and cfg.dummy_weights == "device"
    assert cfg.model_config.num_hidden_layers == 24 and cfg.max_num_seqs == 256
    assert max(cfg.cuda_graph_batch_sizes) == 256 and not cfg.enable_sleep_mode
    assert cfg.kv_blocks() * cfg.block_size >= 256 * (args.prompt_len + args.max_tokens)


def test_summary_percentiles_and_rates():
    results = [{"ttft": 0.1 * i, "e2e": 1.0 + i, "itl": [0.01] * 3, "tokens": 4, "start": 10.0 + i, "end": 12.0 + i}
               for i in range(4)]
    s = bench.summarize(4, results, ["boom"])
    assert s["requests"] == 4 and s["errors"] == 1 and s["first_error"] == "boom"
    assert s["wall_s"] == pytest.approx(5.0) and s["tokens_per_s"] == pytest.approx(16 / 5.0)
    assert s["ttft"]["p50"] == pytest.approx(0.2) and s["ttft"]["p99"] == pytest.approx(0.3)  # nearest rank
    assert s["itl"] == pytest.approx({"p50": 0.01, "p90": 0.01, "p99": 0.01, "mean": 0.01})
    assert s["ttft"]["mean"] == pytest.approx(0.15)
    s = bench.summarize(2, results[::-1], [])  # the first wave by start time, not by arrival in the list
    assert s["ttft_first_wave"] == pytest.approx(0.05) and s["ttft_after"] == pytest.approx(0.25)
    empty = bench.summarize(2, [], ["all failed"])
    assert empty["requests"] == 0 and empty["tokens_per_s"] == 0.0


def test_short_cpu_run_with_client_processes_and_the_offline_baseline(tmp_path):
    out = tmp_path / "serve.json"
    r = run_bench("--tp", "1", "--backend", "mp", "--clients", "2,3", "--client-procs", "2", "--requests", "6",
                  "--max-tokens", "6", "--cycles", "0", "--offline", "--json", str(out), timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads(r.stdout.strip().splitlines()[-1].removeprefix("SUMMARY "))
    assert [level["clients"] for level in summary["levels"]] == [2, 3]
    for level in summary["levels"]:
        assert level["requests"] == 6 and level["errors"] == 0
        assert level["offline_tokens_per_s"] > 0 and level["http_over_offline"] > 0
    full = json.loads(out.read_text())
    assert all(load["output_tokens"] == 36 for load in full["loads"])
    assert all(load["client_cpu"] > 0 for load in full["loads"])  # measured in the client processes
