#!/usr/bin/env bash
# Issue 12 on one H200: HTTP serving (bench/serve.py --device cuda) and the prefill measure
# (bench/gpu.py's prefill section), in one device call of about 4 minutes:
#
#   device run, carry [".whl"]:  bash bench/gpu_serve.sh [serve|prefill|both] [extra bench/serve.py options]
#
# The GPU image has no FastAPI, uvicorn, pydantic, starlette or opentelemetry-api: they travel as
# wheels in .whl/ (ignored by git; `bash bench/gpu_wheels.sh` downloads them), installed to /tmp/site first.
# Logs and JSON go to $OUT (the device tool brings them back).
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-both}
[ $# -gt 0 ] && shift
OUT=${OUT:-/tmp/gpu_serve_out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if [ "$what" != prefill ]; then
  # .whl/ beside the tree, or two levels up (a clean export in .gpu/tree, as gpu_check.sh runs it)
  wheels=$(ls .whl/*.whl ../../.whl/*.whl 2>/dev/null || true)
  [ -n "$wheels" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site $wheels
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
  python3 -c "import fastapi, uvicorn, pydantic, starlette; import service.server.app" \
    || { echo "the wheel set in .whl/ is incomplete"; exit 3; }
  python3 bench/serve.py --device cuda --json "$OUT/serve_cuda.json" --server-log "$OUT/server.log" "$@" \
    2>&1 | tee "$OUT/serve_cuda.log" || echo "bench/serve.py failed (exit ${PIPESTATUS[0]}): see $OUT/server.log"
fi
if [ "$what" != serve ]; then
  python3 bench/gpu.py --skip decode,hf,sleep,fp8,k3,k3graphs,tail --commit "$(git rev-parse --short HEAD 2>/dev/null || echo export)" \
    --json "$OUT/prefill.json" 2>&1 | tee "$OUT/prefill.log"
fi
