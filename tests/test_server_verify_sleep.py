"""Acceptance: `latentserve verify-sleep --model k3-tiny --tp 8` (the seed's plan through HTTP, on
Kimi-K3 as the seed runs it: KDA and MLA layers, latent MoE, 4 layers) passes on CPU. CI's one
TP-8 end-to-end run."""

from __future__ import annotations

import os
import subprocess
import sys

from service.server.launch import REPO


def test_verify_sleep_tp8_prints_the_seed_table_all_green():
    env = {k: v for k, v in os.environ.items() if k != "LATENTSERVE_ADMIN_KEY"}
    r = subprocess.run([sys.executable, "-m", "service.cli", "verify-sleep", "--model", "k3-tiny", "--tp", "8",
                        "--tail-deadline-s", "5"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=1500)
    out = r.stdout
    print(out)
    assert r.returncode == 0, out[-6000:] + r.stderr[-4000:]
    row = next(line for line in out.splitlines() if line.startswith("| latentserve (TP 8"))
    assert row.count("16/16") == 4 and "3 / 3 on all 8 ranks, fused path taken" in row
    control = next(line for line in out.splitlines() if line.startswith("| Negative control"))
    assert "clear, timely error" in control and "TailTimeout" in control
    assert "RESULT: PASS" in out
