#!/usr/bin/env bash
# Bare-metal head: start Ray on this node (it hosts ranks 0..GPUS_PER_NODE-1 and the TP
# rendezvous), wait until the other nodes have joined with the TP group's GPUs, then run the
# controller in the foreground.
#
#   export LATENTSERVE_ADMIN_KEY=...            # admin API (/sleep, /wake_up, ...); unset = off
#   deploy/ray-head.sh deploy/env/gb200-mnnvl.env deploy/examples/gb200-tp8-2x4.env
#
# Environment (from the env files or the shell): LATENTSERVE_MODEL, LATENTSERVE_TP,
# LATENTSERVE_GPUS_PER_NODE, LATENTSERVE_NODES, and optionally LATENTSERVE_HF_OVERRIDES,
# LATENTSERVE_DEVICE (cuda), LATENTSERVE_DTYPE, LATENTSERVE_FUSED_TAIL, LATENTSERVE_MAX_MODEL_LEN,
# LATENTSERVE_SLEEP_MODE (1/0), LATENTSERVE_PRESERVE_GLOBS (space-separated), LATENTSERVE_PORT,
# LATENTSERVE_HOST, LATENTSERVE_EXTRA_ARGS, RAY_PORT (6379), RAY_WAIT_S (900),
# LATENTSERVE_SERVE=0 (start Ray only), LATENTSERVE_VENV, LATENTSERVE_NODE_IP, LATENTSERVE_DRY_RUN=1.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=deploy/lib.sh
source "$here/lib.sh"

load_env "$@"
require LATENTSERVE_MODEL LATENTSERVE_TP LATENTSERVE_GPUS_PER_NODE
check_topology
check_imex

run ray start --head --port="${RAY_PORT:-6379}" --node-ip-address="$(node_ip)" \
  --num-gpus="$LATENTSERVE_GPUS_PER_NODE" --dashboard-host=0.0.0.0

[[ "${LATENTSERVE_SERVE:-1}" == 1 ]] || exit 0

# The controller asks Ray for one GPU per rank; say what is missing instead of waiting mutely.
echo "+ wait for $LATENTSERVE_TP GPUs in the Ray cluster (up to ${RAY_WAIT_S:-900} s)"
if ! dry_run; then
  python3 - "$LATENTSERVE_TP" "${RAY_WAIT_S:-900}" <<'EOF'
import sys
import time

import ray

need, deadline = float(sys.argv[1]), time.monotonic() + float(sys.argv[2])
ray.init(address="auto", logging_level="ERROR")
last = None
while (have := ray.cluster_resources().get("GPU", 0.0)) < need:
    if have != last:
        print(f"latentserve deploy: {have:g}/{need:g} GPUs in the Ray cluster; start ray-worker.sh on the other nodes",
              file=sys.stderr)
        last = have
    if time.monotonic() > deadline:
        sys.exit(f"latentserve deploy: only {have:g} of {need:g} GPUs joined before RAY_WAIT_S ran out")
    time.sleep(2)
EOF
fi

serve=(serve --ray-address auto --host "${LATENTSERVE_HOST:-0.0.0.0}" --port "${LATENTSERVE_PORT:-8000}"
       --model "$LATENTSERVE_MODEL" --tp "$LATENTSERVE_TP" --device "${LATENTSERVE_DEVICE:-cuda}"
       --dtype "${LATENTSERVE_DTYPE:-bfloat16}" --fused-tail "${LATENTSERVE_FUSED_TAIL:-auto}")
[[ -z "${LATENTSERVE_HF_OVERRIDES:-}" ]] || serve+=(--hf-overrides "$LATENTSERVE_HF_OVERRIDES")
[[ -z "${LATENTSERVE_MAX_MODEL_LEN:-}" ]] || serve+=(--max-model-len "$LATENTSERVE_MAX_MODEL_LEN")
read -r -a globs <<< "${LATENTSERVE_PRESERVE_GLOBS:-}"
if [[ "${LATENTSERVE_SLEEP_MODE:-1}" == 1 ]]; then
  serve+=(--enable-sleep-mode)
  (( ${#globs[@]} == 0 )) || serve+=(--sleep-preserve-parameter-names "${globs[@]}")
elif (( ${#globs[@]} > 0 )); then
  die "LATENTSERVE_PRESERVE_GLOBS needs LATENTSERVE_SLEEP_MODE=1"
fi
read -r -a extra <<< "${LATENTSERVE_EXTRA_ARGS:-}"
serve+=("${extra[@]}")

# The key reaches the controller through the environment, never its argv (visible in ps).
[[ -n "${LATENTSERVE_ADMIN_KEY:-}" ]] || say "LATENTSERVE_ADMIN_KEY is not set: the admin API (/sleep, /wake_up, /update_weights) is off"
run_exec latentserve "${serve[@]}"
