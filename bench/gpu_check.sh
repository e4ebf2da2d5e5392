#!/usr/bin/env bash
# One device call that re-checks issue 12's GPU work on a clean export of HEAD. Two halves, one
# call each: on a cold H200 the GPU tests alone took ~490 s (run9, 2026-12-03: Inductor and
# Triton compile everything first), and `bench` (decode bf16 and FP8 with in-run baselines,
# prefill with its variants, then HTTP serving at 64 and 256 streams with the engine's step
# phases) ~400 s. The persistent-kernel probe and the mixed-step warm-up check answered in run
# 47; bench/persistent_probe.py and bench/mixed_steps.py stay for reruns by hand. `all` runs
# the bench first, so a short budget still measures. `sweeps` (a call
# of its own) times launch shapes: the grouped experts at 8/64/256 tokens with the down kernel's
# own shape, and the GEMV at 128 and 256 rows (with TESTS=..., those GPU tests in place of the GEMV
# sweep; the grouped sweep runs either way).
# `k3_tests` is the gate for Kimi-K3's step kernel as a default: greedy tokens in CUDA graphs
# against eager with the K3 switches on, and the KDA layer's graph replays (runs 55-56: the step
# kernel diverged in graphs; run 57: fixed, passes). Give it a whole call (~560 s): run 56 ran out
# at 571 s before its bf16 cases, with builds since cut. `fp8`: FP8 decode with its projections
# of 2-64 rows on the GEMV's tiles against the wide-tile baseline and bf16.
# `quick`: the bench without serving, then K3 at TP 2 and the engine's graph tests, in one call.
# `serve_async`: HTTP serving at 64 and 256 streams with async output (the CUDA default), then
# the same on a server with `--async-output off`, and the ratio; then the engine's CUDA tests.
# `save_cache`: packs the Triton and Inductor caches the lease built into $OUT (copy the parts
# into .gpu/cache/, which every call restores first). `mixed`:
# bench/mixed_steps.py (a mixed step's host part and syncs), then serving both ways (the TTFT of
# the hand-over before a prefill launch, 5cc1275). `serve_http`: serving at 64 and 256 streams
# with py-spy (bench/server_profile.py) on the server's processes at 256 (runs 78-79: clients
# waited ~100 ms more for a first token than the server's clock says, with its HTTP process at
# 0.75-0.8 of a core); `bench_http`: `bench`, then `serve_http`. Serving prints each load's
# first-token split (`first_token_ms`: admit, queue, device, report, rest), the HTTP process's
# cores (`api_cpu`) and loop lag. `serve_ab SECONDS DIR`: 256 streams on this export's server
# and on the export in DIR (e.g. ../base), alternating, twice each (AB_PAIRS=3: three times; a
# server takes ~75 s: 55 s to start, 13 s of load): a change to the HTTP process.
# `goal`: the decode goal table alone (a short budget; BASELINES=a,b adds bench/gpu.py baselines,
# PROFILE=1,8,64,256 each batch's exposed kernel times). `cuda_c`: the CUDA C kernels' GPU tests, then
# `goal` with their baselines. `ncu_mla`: ncu on the CUDA C MLA split kernel
# at 1 and 8 sequences. `mla_tma`: MLA
# decode's TMA tiles standalone against the cp.async kernel at 64 and 256 sequences, then `goal` with their baselines and tests. `serve_std`: the same with uvloop and
# httptools (wheels in .whl/std/) against asyncio and h11. `serve_gil`: the same with Python's GIL
# hand-over interval at GIL_MS (default 1) against its 5 ms, in every process of the serve.
# Every group writes $OUT/<group>.txt; the summary lines go to stdout.
#
#   git archive HEAD | tar -x -C .gpu/tree        # a clean export (ignored folder)
#   cp <files_at>/compile_cache.tar.xz.part* .gpu/cache/   # after a save_cache call
#   device run, carry [".gpu", ".whl"]:  bash .gpu/tree/bench/gpu_check.sh [bench|bench_http|quick|serve_async|serve_http|mixed|sweeps|k3|k3_tests|fp8|small_rows|tests_kernels|tests_kda|tests_engine|all|save_cache|serve_ab|serve_std|serve_gil|goal|goal_ncu|cuda_c|ncu_gemv|ncu_mla|mla_tma|mla_tma_kernel] [seconds] [other export]
#
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-bench}
budget=${2:-480}
OUT=${OUT:-/tmp/gpu_check_out}
mkdir -p "$OUT"
wheels=$(ls ../../.whl/*.whl .whl/*.whl 2>/dev/null)
[ -n "$wheels" ] && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site $wheels >/dev/null 2>&1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} TORCHINDUCTOR_COMPILE_THREADS=1 PYTHONUNBUFFERED=1
# Compile caches from an earlier lease (bench/gpu_cache.py): .gpu/cache/ travels with .gpu.
eval "$(python3 bench/gpu_cache.py dirs)"
python3 bench/gpu_cache.py restore ../cache
if [ "$what" = save_cache ]; then  # a short last call of a lease: the caches this machine built
  python3 bench/gpu_cache.py save "$OUT" --max-mib 45
  exit $?
fi
t0=$(date +%s)
left() { echo $(( budget - ($(date +%s) - t0) )); }
group() {  # name, seconds, pytest args...
  local name=$1 t=$2 s; shift 2
  [ "$(left)" -lt 20 ] && { echo "== $name skipped: out of time"; return; }
  [ "$t" -gt "$(left)" ] && t=$(left)
  s=$(date +%s)
  # -v: a group killed by its timeout still names each test it ran and how it ended
  timeout "$t" python3 -m pytest -v -rfE -p no:cacheprovider -s "$@" > "$OUT/$name.txt" 2>&1
  echo "== $name rc=$? $(( $(date +%s) - s ))s: $(grep -E 'passed|failed|error|skipped|no tests ran' "$OUT/$name.txt" | tail -1)"
}
commit=$(cat COMMIT 2>/dev/null || git rev-parse --short HEAD 2>/dev/null || echo export)
if { [ "$what" = bench ] || [ "$what" = bench_http ] || [ "$what" = all ] || [ "$what" = quick ]; } && [ "$(left)" -gt 120 ]; then
  s=$(date +%s)
  baselines=same_build,addmm,no_pdl
  [ "$what" = quick ] && baselines=same_build,small_batch,mla_16_warps,align_kernel
  timeout "$(( $(left) > 470 ? 470 : $(left) ))" python3 bench/gpu.py --commit "$commit" \
    --skip hf,sleep,k3,k3graphs,tail,prefill,fp8 --batches 1,8,64,256 --profile-batches 1,8,64,256 --baselines "$baselines" \
    --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "== bench rc=$? $(( $(date +%s) - s ))s"
  grep -E "decode batch|fp8 decode|prefill|achieved|baseline|capture_failed|FLOOR INVALID|no_pdl profile| us/layer" "$OUT/bench.log" | cut -c1-260
  if [ "$what" != quick ] && [ "$(left)" -gt 150 ]; then
    s=$(date +%s)
    OUT="$OUT" timeout "$(( $(left) - 10 ))" bash bench/gpu_serve.sh serve --requests 256 > "$OUT/serve_all.log" 2>&1
    echo "== serve rc=$? $(( $(date +%s) - s ))s"
    grep -E "serve-bench" "$OUT/serve_all.log" | cut -c1-900  # execute_<kind>_ms / _max_ms: slow mixed steps
  fi
fi
if [ "$what" = mixed ]; then  # a mixed step's host part and host syncs (~150 s), then serving both ways
  timeout 240 python3 bench/mixed_steps.py --wave 256 --waves 2 --json "$OUT/mixed_steps.json" > "$OUT/mixed_steps.log" 2>&1
  echo "== mixed_steps rc=$?"; grep -E "wave [0-9]|first wave|warm mixed" "$OUT/mixed_steps.log" | cut -c1-700
  OUT="$OUT" timeout "$(( $(left) - 10 ))" bash bench/gpu_serve.sh serve --no-offline --baseline-args "--async-output off" \
    > "$OUT/serve_async.log" 2>&1
  echo "== serve_async rc=$?"
  grep -E "serve-bench|throughput" "$OUT/serve_async.log" | cut -c1-900
fi
if [ "$what" = serve_http ] || [ "$what" = bench_http ]; then  # py-spy of the server's processes at 256 streams
  OUT="$OUT" timeout "$(( $(left) - 10 ))" bash bench/gpu_serve.sh serve --no-offline --py-spy /tmp/site/bin/py-spy \
    > "$OUT/serve_spy.log" 2>&1
  echo "== serve_spy rc=$?"
  grep -E -A80 "serve-bench|py-spy of" "$OUT/serve_spy.log" | grep -v "^\s*$" | cut -c1-1200 | head -150
fi
serve256() {  # label, export folder, PYTHONPATH prefix: one server's 256-stream load (serve_ab, serve_std); SERVE_ARGS: more bench/serve.py options
  # The client processes named, so an A/B against an export from before the 8-process default has the same clients.
  PYTHONPATH=$3$PYTHONPATH OUT="$OUT/$1" timeout "$(( $(left) > 150 ? 150 : $(left) ))" bash "$2/bench/gpu_serve.sh" \
    serve --no-offline --clients 256 --requests 2048 --client-procs 8 ${SERVE_ARGS:-} > "$OUT/serve_$1.log" 2>&1
  echo "== serve $1 rc=$?"; grep -E "256 clients" "$OUT/serve_$1.log" | cut -c1-1500
}
if [ "$what" = serve_ab ]; then  # this tree's server against another export's ($3), alternating, 256 streams
  base=${3:?serve_ab needs the folder of the other export}
  for i in $(seq 1 "${AB_PAIRS:-2}"); do serve256 "base$i" "$base" ""; serve256 "this$i" . ""; done
fi
if [ "$what" = mla_tma ] || [ "$what" = mla_tma_kernel ]; then  # MLA decode's TMA tiles (mla_decode_tma.py): standalone, then in the engine (`mla_tma_kernel`: standalone only, for a short budget)
  # Run 99 timed the first version (a synchronous block-id load before each copy): 1.11x the cp.async
  # kernel standalone, 1.03-1.04x in the engine. Run 100-101, the split's ids in registers: 1.01x / 0.98x
  # standalone at 64 / 256, the step 0.99-1.00x.
  for t in 0 1; do
    LATENTSERVE_MLA_TMA=$t timeout 60 python3 bench/mla_decode.py --batches 64 256 --write-kv --in-order \
      --block-size $((16 + 16 * t)) > "$OUT/mla_tma$t.log" 2>&1
    echo "== mla standalone, TMA $t rc=$?"; cut -c1-170 "$OUT/mla_tma$t.log"
  done
  # Registers hold it to 2 programs an SM; capped at 168 (3 an SM at 2 stages) it spills ~78 local
  # accesses a tile, compiled for sm_90 (bench/triton_ir.py): which way that goes only a GPU says.
  # At 8 warps: 193 registers, no spill, 403 instructions a tile, 1 program (8 warps) an SM.
  [ "$(left)" -gt 20 ] && timeout "$(( $(left) > 150 ? 150 : $(left) ))" python3 bench/mla_decode.py --batches 64 256 --write-kv --in-order --block-size 32 --sweep --tma \
    --splits 1 4 --block-n 32 --warps 4 8 --stages 2 3 --maxnreg 0 168 > "$OUT/mla_tma_sweep.log" 2>&1
  echo "== mla TMA sweep rc=$?"; grep -o '"fastest.*' "$OUT/mla_tma_sweep.log" | cut -c1-700
  [ "$what" = mla_tma ] && BASELINES=${BASELINES:-kv_block_32,mla_tma,mla_tma_64} TESTS=${TESTS:-tests/gpu/test_mla_decode_kernel.py} what=goal
fi
if [ "$what" = cuda_c ]; then  # the hand-written CUDA C kernels: their GPU tests first, then the goal table with their baselines
  # The first three test files in the order runs 120-121 ran them (the MLA kernel's engine graph
  # test failed there only); then the table with the kernels against the Triton ones and the candidates.
  # CUDA_C_TESTS: fewer test files for a short budget.
  group tests_cuda_c 270 ${CUDA_C_TESTS:-tests/gpu/test_cuda_c_loads.py tests/gpu/test_gemv_cuda.py \
    tests/gpu/test_mla_cuda.py tests/gpu/test_add_norm.py}
  grep -E "^FAILED|^E  .*assert|graph step " "$OUT/tests_cuda_c.txt" | cut -c1-250 | head -24
  BASELINES=${BASELINES:-same_build,mla_cuda_off,gemv_cuda_off,gemv_cuda_k8} what=goal
fi
if [ "$what" = goal ] || [ "$what" = goal_ncu ]; then  # the goal table alone (decode floor/step at 1/8/64/256), for a short budget
  reserve=5 profile=${PROFILE:-}  # PROFILE=1,8,64,256: each batch's exposed kernel times too
  [ "$what" = goal_ncu ] && reserve=200 profile=1,8,64,256  # ncu_gemv's share of the call; each batch's exposed times
  timeout "$(( $(left) - reserve ))" python3 bench/gpu.py --commit "$commit" --skip hf,sleep,k3,k3graphs,tail,prefill,fp8 \
    --batches 1,8,64,256 --profile-batches "$profile" --baselines "${BASELINES:-same_build}" --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
  echo "== goal rc=$?"; grep -E "copy bandwidth|decode batch|baseline|FLOOR INVALID" "$OUT/bench.log" | cut -c1-330
  [ -n "$profile" ] && grep -A 15 "^exposed under PDL" "$OUT/bench.log" | cut -c1-120  # what each kernel costs the step with PDL on
  [ -n "${TESTS:-}" ] && group tests "$(left)" $TESTS  # TESTS="tests/gpu/x.py ...": the candidates' GPU tests after
fi
if [ "$what" = serve_std ]; then  # uvicorn's standard extras (uvloop, httptools: gpu_wheels.sh puts them in .whl/std) against asyncio and h11
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site_std ../../.whl/std/*.whl > /dev/null 2>&1
  PYTHONPATH=/tmp/site_std:$PYTHONPATH python3 -c "import uvloop, httptools; print('== std:', uvloop.__version__, httptools.__version__)"
  for i in 1 2; do serve256 "stdlib$i" . ""; serve256 "std$i" . /tmp/site_std:; done
fi
if [ "$what" = serve_gil ]; then  # the GIL hand-over interval: 5 ms (Python's) against GIL_MS (default 1) in every process
  # A sitecustomize on PYTHONPATH sets it in the HTTP process, the spawned ranks and the bench's clients alike.
  mkdir -p /tmp/site_gil && echo "import sys; sys.setswitchinterval(${GIL_MS:-1} / 1000)" > /tmp/site_gil/sitecustomize.py
  PYTHONPATH=/tmp/site_gil:$PYTHONPATH python3 -c "import sys; print('== gil: switch interval', sys.getswitchinterval())"
  for i in $(seq 1 "${AB_PAIRS:-2}"); do serve256 "gil5ms$i" . ""; serve256 "gil${GIL_MS:-1}ms$i" . /tmp/site_gil:; done
fi
if [ "$what" = sweeps ]; then  # launch shapes that only a GPU can choose: grouped experts, GEMV above 64 rows
  timeout "$(( $(left) > 330 ? 330 : $(left) ))" python3 bench/moe_grouped.py --m 8,64,256 --sweep --iters 100 \
    > "$OUT/moe_grouped_sweep.log" 2>&1
  echo "== moe_grouped sweep rc=$?"; grep -E "^M=|^best" "$OUT/moe_grouped_sweep.log" | cut -c1-400
  if [ -n "${TESTS:-}" ]; then  # TESTS="tests/gpu/x.py ...": those instead of the GEMV sweep
    group tests "$(left)" $TESTS
  else
    timeout "$(( $(left) - 10 ))" python3 bench/gemv.py --rows 128 256 --sweep \
      --shapes fused_qkv_a q_b o_proj latent_up shared_down --json "$OUT/gemv_256.json" > "$OUT/gemv_256.log" 2>&1
    echo "== gemv sweep rc=$?"; cut -c1-300 "$OUT/gemv_256.log" | grep -v "^ "
  fi
fi
if [ "$what" = small_rows ]; then  # the two kernels furthest over their bytes at 1 and 8 sequences
  # Run 58's no-PDL profile: the MLA split kernel 10.0 / 13.5 us a layer for 0.3 / 2.2 us of KV at
  # copy bandwidth, the MoE entry kernel 8.6 us at 8 rows for ~2.5. The entry kernel against cuBLAS
  # and its launch shapes at 2, 8 and 16 rows (run 62 swept 8 only); the MLA launch shapes at 1 and
  # 8 (the engine's variant: writes the new row, blocks in order), 16 warps too (sm_90, 32-token
  # tiles: 128 registers, no spills); last, ncu on the MLA split kernel at 1 and 8.
  timeout 150 python3 bench/moe_entry.py --rows 1 2 8 16 64 > "$OUT/moe_entry.log" 2>&1
  echo "== moe_entry rc=$?"; cut -c1-300 "$OUT/moe_entry.log"
  timeout 200 python3 bench/moe_entry.py --rows 2 8 16 --sweep --block-k 128 256 512 --json "$OUT/moe_entry_8.json" \
    > "$OUT/moe_entry_sweep.log" 2>&1
  echo "== moe_entry sweep rc=$?"; grep -v "shapes timed" "$OUT/moe_entry_sweep.log" | cut -c1-700
  timeout "$(( $(left) > 400 ? $(left) - 150 : $(left) / 2 ))" python3 bench/mla_decode.py --batches 1 8 --write-kv \
    --in-order --sweep --splits 8 16 32 64 --block-n 16 32 64 --warps 4 8 16 --stages 1 --json "$OUT/mla_small.json" \
    > "$OUT/mla_small.log" 2>&1
  echo "== mla sweep rc=$?"; cut -c1-700 "$OUT/mla_small.log"
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  for b in 1 8; do
    [ "$(left)" -lt 40 ] && break
    timeout "$(( $(left) / 2 ))" "${ncu:-ncu}" --clock-control none --kernel-name _mla_decode_split --launch-skip 2 \
      --launch-count 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
      --section LaunchStats --section MemoryWorkloadAnalysis --section SourceCounters \
      python3 bench/mla_decode.py --batches "$b" --write-kv --in-order > "$OUT/ncu_mla_b$b.txt" 2>&1
    echo "== ncu mla batch $b rc=$?"
    grep -E "Duration|Elapsed Cycles|Registers Per|Eligible Warps|Warp Cycles Per Issued|DRAM Throughput|stalled" \
      "$OUT/ncu_mla_b$b.txt" | cut -c1-200 | head -12
  done
fi
if [ "$what" = ncu_gemv ] || [ "$what" = goal_ncu ]; then  # where a GEMV of 8-64 rows spends ~6 us on ~1.3 us of weights
  # Runs 39-40: at 64 rows our tiles and cuBLAS both take ~6 us for fused_qkv_a and o_proj, and
  # split-K (a third of the x bytes from L2) was slower. ncu says which bound it is: L2 or DRAM
  # throughput, the tensor pipe, or stalls. `goal_ncu`: the goal block above first (one call's worth).
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  for case in "o_proj 64 _gemv_kernel" "fused_qkv_a 64 _gemv_kernel" "o_proj 8 _gemv_kernel" "o_proj 64 regex:nvjet|gemm|sm90"; do
    set -- $case
    [ "$(left)" -lt 40 ] && break
    tag="$1_$2_$( [ "$3" = _gemv_kernel ] && echo ours || echo cublas )"
    # Run 103 flushed L2 before each kernel (ncu's default), so x came from DRAM: warm L2 since, as in a step.
    timeout "$(( $(left) > 120 ? 110 : $(left) - 10 ))" "${ncu:-ncu}" --clock-control none --cache-control none --kernel-name "$3" \
      --launch-skip 3 --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \
      --section SchedulerStats --section Occupancy --section LaunchStats --section ComputeWorkloadAnalysis \
      python3 bench/gemv.py --rows "$2" --shapes "$1" --skip-experts > "$OUT/ncu_$tag.txt" 2>&1
    echo "== ncu $tag rc=$?"
    grep -E "^  [a-z_]|Duration|Elapsed Cycles|Memory Throughput|DRAM Throughput|L2 Cache Throughput|L1/TEX Cache Throughput|Compute \(SM\)|Registers Per|Grid Size|Eligible Warps|Warp Cycles Per Issued|Achieved Occupancy|Issue Slots Busy|Max Bandwidth" \
      "$OUT/ncu_$tag.txt" | cut -c1-160 | head -24
  done
fi
if [ "$what" = ncu_mla ]; then  # what is left of the CUDA C split kernel's 7.8 us a layer at one sequence (run 117)
  # The memory chain after the PDL wait (context length, block table, KV tile), the fp32 partials'
  # stores or the tile's barriers: ncu's stall reasons say which. Warm L2, as in a step.
  ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -1)
  for rows in 1 8; do
    [ "$(left)" -lt 40 ] && break
    timeout "$(( $(left) > 120 ? 110 : $(left) - 10 ))" "${ncu:-ncu}" --clock-control none --cache-control none \
      --kernel-name mla_split_small --launch-skip 3 --launch-count 1 --section SpeedOfLight --section WarpStateStats \
      --section SchedulerStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis \
      --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
      python3 bench/mla_decode.py --batches "$rows" --write-kv --in-order --cuda > "$OUT/ncu_mla_$rows.txt" 2>&1
    echo "== ncu mla_split_small $rows rc=$?"
    grep -E "Duration|Elapsed Cycles|DRAM Throughput|Registers Per|Grid Size|Eligible Warps|Warp Cycles Per Issued|Issue Slots Busy|Stall" \
      "$OUT/ncu_mla_$rows.txt" | cut -c1-160 | head -24
    # each stall reason's warps a issued instruction, the largest first (the sections name only the top one)
    grep -E "issue_stalled_.*ratio" "$OUT/ncu_mla_$rows.txt" | awk '{print $NF, $1}' | sort -rn | head -8
  done
fi
if [ "$what" = k3 ]; then  # Kimi-K3's structure (KDA + MLA layers) in decode graphs, eager and graphed
  # Candidates against none (the defaults) in one process (bench/gpu.py's K3_CONFIGS): the builds
  # after the first find the compile caches warm. `fla`: the path before run 61 made K3's four
  # decode kernels the defaults; `step_wide`, `step_split`: the step kernel's launch shapes up to 8
  # sequences (run 61: within noise of the default); last, `no_pdl`, whose profile gives each kernel its own time.
  timeout 60 python3 bench/alias_probe.py cuda 2>&1 | grep alias_probe  # the step kernel's fix's cause
  timeout "$(( $(left) - 10 ))" python3 bench/gpu.py --commit "$commit" --skip decode,hf,sleep,fp8,k3,prefill,tail \
    --batches 1,8,64 --profile-batches 1,64 --k3-configs none,fla,step_wide,step_split,no_pdl --json "$OUT/k3graphs.json" \
    > "$OUT/k3graphs.log" 2>&1
  echo "== k3graphs rc=$?"
  grep -E "k3-small|capture_failed|Error|^ +_|^ +triton|nvjet" "$OUT/k3graphs.log" | cut -c1-300 | head -80
fi
if [ "$what" = fp8 ]; then  # FP8 decode against bf16 and against its wide-tile baseline, then its kernel tests
  timeout "$(( $(left) > 400 ? 400 : $(left) ))" python3 bench/gpu.py --commit "$commit" \
    --skip hf,sleep,k3,k3graphs,tail,prefill --batches 1,8,64,256 --profile-batches 8,64,256 --baselines "" \
    --json "$OUT/fp8.json" > "$OUT/fp8.log" 2>&1
  echo "== fp8 bench rc=$?"
  grep -E "decode batch|fp8 decode|FP8|baseline|logits|capture_failed|Error" "$OUT/fp8.log" | cut -c1-260
  group fp8_tests "$(left)" tests/gpu/test_fp8.py tests/gpu/test_moe_entry.py -k "linear or w8a8 or fp8"
fi
if [ "$what" = quick ]; then  # one call's worth when machines are scarce: the bench, then the GPU checks not yet run
  # The engine first: async output (the CUDA default since 2026-12-06) against in order, on CUDA.
  group engine 200 tests/gpu/test_engine_cuda.py tests/gpu/test_prefill_graphs.py
  group k3_tp "$(left)" tests/gpu/test_k3_tp.py
fi
if [ "$what" = serve_async ]; then  # served tok/s with a step's outputs processed during the next step, against in order
  OUT="$OUT" timeout "$(( $(left) > 400 ? 380 : $(left) - 20 ))" bash bench/gpu_serve.sh serve --no-offline --baseline-args "--async-output off" \
    > "$OUT/serve_async.log" 2>&1
  echo "== serve_async rc=$?"
  grep -E "serve-bench|throughput" "$OUT/serve_async.log" | cut -c1-900
  group engine "$(left)" tests/gpu/test_engine_cuda.py tests/gpu/test_prefill_graphs.py  # what is left of the call
fi
if [ "$what" = k3_tests ]; then
  group k3_tests "$(left)" tests/gpu/test_k3_tp.py tests/gpu/test_k3_graphs_cuda.py tests/gpu/test_kda_cuda.py
fi
# The GPU tests take three calls on a cold machine (run 71, H100, 2026-12-06: the kernel group
# alone ran out at 300 s after 197 of its tests): `tests_kernels`, `tests_kda` (KDA, FP8, device
# comm), `tests_engine` (TP graphs, the engine); `all` runs them all.
if [ "$what" = tests_kernels ] || [ "$what" = all ]; then
  group kernels 560 tests/gpu/test_pdl.py tests/gpu/test_gemv.py tests/gpu/test_moe_entry.py tests/gpu/test_moe_entry_select.py \
    tests/gpu/test_moe_kernels.py tests/gpu/test_qb_norms.py \
    tests/gpu/test_moe_grouped_kernel.py tests/gpu/test_moe_grouped.py tests/gpu/test_mla_prefill_sdpa.py \
    tests/gpu/test_mla_absorb.py tests/gpu/test_mla_decode_kernel.py
fi
if [ "$what" = tests_kda ] || [ "$what" = all ]; then
  group kda 300 tests/gpu/test_kda_decode_step.py tests/gpu/test_kda_decode_conv.py tests/gpu/test_gemv_multi.py \
    tests/gpu/test_kda_cuda.py tests/gpu/test_attn_res_kernel.py
  group fp8 150 tests/gpu/test_fp8.py
  group comm 60 tests/gpu/test_device_comm.py
fi
if [ "$what" = tests_engine ] || [ "$what" = all ]; then
  group tp 250 tests/gpu/test_tp_graphs.py
  group engine 300 tests/gpu/test_dense_mm_cuda.py tests/gpu/test_engine_cuda.py tests/gpu/test_fusion.py tests/gpu/test_prefill_graphs.py
fi
if [ "$what" = all ]; then
  group k3 300 tests/gpu/test_k3_tp.py tests/gpu/test_k3_graphs_cuda.py
fi
if [[ "$what" == tests_* ]] || [ "$what" = all ]; then
  grep -h -E "capture_failed|capture_recompile|FAILED|ERROR" "$OUT"/*.txt | cut -c1-300 | head -30
  true  # no such line is the good case: not the call's exit status (run 123 "failed" on grep's 1)
fi
