#!/usr/bin/env bash
# Bare-metal worker: join this node's GPUs to the head's Ray cluster and stay in the
# foreground (run it under systemd, tmux or your scheduler). The TP ranks land here as Ray
# actors and inherit this environment, NCCL settings included.
#
#   RAY_HEAD_ADDRESS=NODE0_IP:6379 deploy/ray-worker.sh deploy/env/gb200-mnnvl.env deploy/examples/gb200-tp8-2x4.env
#
# Environment: RAY_HEAD_ADDRESS (required), LATENTSERVE_GPUS_PER_NODE, and optionally
# LATENTSERVE_VENV, LATENTSERVE_NODE_IP, LATENTSERVE_DRY_RUN=1.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
# shellcheck source=deploy/lib.sh
source "$here/lib.sh"

load_env "$@"
require RAY_HEAD_ADDRESS LATENTSERVE_GPUS_PER_NODE
check_imex

run_exec ray start --address="$RAY_HEAD_ADDRESS" --node-ip-address="$(node_ip)" \
  --num-gpus="$LATENTSERVE_GPUS_PER_NODE" --block
