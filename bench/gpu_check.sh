#!/usr/bin/env bash
# One device call that re-checks issue 12's GPU work on a clean export of HEAD: the GPU tests in
# groups (each with its own time limit, so one slow group cannot take the others' output), then
# bench/gpu.py's decode (bf16 and FP8, replay profiles), K3 graphs and prefill (with its in-run
# variants). Every group writes $OUT/<group>.txt; the summary lines go to stdout.
#
#   git archive HEAD | tar -x -C .gpu/tree        # a clean export (ignored folder)
#   device run, carry [".gpu", ".whl"]:  bash .gpu/tree/bench/gpu_check.sh [tests|bench|all] [seconds]
#
# The default budget (480 s) fits one call with the machine's start; `tests` alone takes ~300 s.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
budget=${2:-480}
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
wheels=$(ls ../../.whl/*.whl .whl/*.whl 2>/dev/null)
[ -n "$wheels" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site $wheels >/dev/null 2>&1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} TORCHINDUCTOR_COMPILE_THREADS=1 PYTHONUNBUFFERED=1
t0=$(date +%s)
left() { echo $(( budget - ($(date +%s) - t0) )); }
group() {  # name, seconds, pytest args...
  local name=$1 t=$2 s; shift 2
  [ "$(left)" -lt 20 ] && { echo "== $name skipped: out of time"; return; }
  [ "$t" -gt "$(left)" ] && t=$(left)
  s=$(date +%s)
  timeout "$t" python3 -m pytest -q -p no:cacheprovider -s "$@" > "$OUT/$name.txt" 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s ))s: $(grep -E 'passed|failed|error|skipped|no tests ran' "$OUT/$name.txt" | tail -1)"
}
commit=$(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo export)
if [ "$what" != bench ]; then
  group kernels 90 tests/gpu/test_gemv.py tests/gpu/test_moe_entry.py tests/gpu/test_moe_kernels.py \
    tests/gpu/test_moe_grouped_kernel.py tests/gpu/test_moe_grouped.py tests/gpu/test_mla_prefill_sdpa.py
  group fp8 100 tests/gpu/test_fp8.py
  group comm 60 tests/gpu/test_device_comm.py
  group tp 150 tests/gpu/test_tp_graphs.py
  group engine 100 tests/gpu/test_engine_cuda.py tests/gpu/test_fusion.py
  group k3 300 tests/gpu/test_k3_graphs_cuda.py
  grep -h -E "capture_failed|capture_recompile|FAILED" "$OUT"/*.txt | cut -c1-300 | head -20
fi
if [ "$what" != tests ] && [ "$(left)" -gt 120 ]; then
  s=$(date +%s)
  timeout "$(left)" python3 bench/gpu.py --commit "$commit" --skip hf,sleep,k3,tail --batches 1,8,64,256 \
    --profile-batches 1,64 --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "== bench rc=$? $(( $(date +%s) - s ))s"
  grep -E "decode batch|fp8 decode|k3-small decode|prefill|achieved|baseline|capture_failed" "$OUT/bench.log" | cut -c1-260
fi
