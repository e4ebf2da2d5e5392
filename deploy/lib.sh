# shellcheck shell=bash
# Shared by ray-head.sh and ray-worker.sh (sourced, not run).
# LATENTSERVE_DRY_RUN=1 prints every command and the exported NCCL/CUDA environment instead
# of running anything: for review, and for the test suite.

die() { echo "latentserve deploy: $*" >&2; exit 1; }
say() { echo "latentserve deploy: $*" >&2; }
dry_run() { [[ "${LATENTSERVE_DRY_RUN:-0}" == 1 ]]; }

# Export every variable the env files set; later files override earlier ones.
load_env() {
  [[ $# -ge 1 ]] || die "usage: $0 ENV_FILE... (e.g. deploy/env/gb200-mnnvl.env deploy/examples/gb200-tp8-2x4.env)"
  local f
  for f in "$@"; do
    [[ -f "$f" ]] || die "no env file $f"
    set -a
    # shellcheck disable=SC1090
    source "$f"
    set +a
  done
  # A venv that is not activated: put its bin first so ray, latentserve and python agree.
  if [[ -n "${LATENTSERVE_VENV:-}" ]]; then
    [[ -x "$LATENTSERVE_VENV/bin/latentserve" ]] || die "LATENTSERVE_VENV=$LATENTSERVE_VENV has no bin/latentserve"
    export PATH="$LATENTSERVE_VENV/bin:$PATH"
  fi
  if dry_run; then
    env | grep -E '^(NCCL|GLOO|CUDA|TORCH_SYMM|NVSHMEM)_' | sort | sed 's/^/env /'
  fi
}

require() {
  local name
  for name in "$@"; do
    [[ -n "${!name:-}" ]] || die "$name is not set (see deploy/examples/*.env)"
  done
}

# This node's address as the other nodes reach it; override when the first address is wrong.
node_ip() {
  if [[ -n "${LATENTSERVE_NODE_IP:-}" ]]; then echo "$LATENTSERVE_NODE_IP"; return; fi
  hostname -I 2>/dev/null | awk '{print $1}'
}

# A TP group fills whole nodes: nodes * gpus-per-node ranks, one GPU each.
check_topology() {
  local tp=$LATENTSERVE_TP gpn=$LATENTSERVE_GPUS_PER_NODE nodes=${LATENTSERVE_NODES:-1}
  if (( tp > gpn )); then
    (( tp == nodes * gpn )) || die "LATENTSERVE_TP=$tp must equal LATENTSERVE_NODES=$nodes x LATENTSERVE_GPUS_PER_NODE=$gpn"
  fi
}

# Cross-node NVLink peer mappings need an IMEX channel (nvidia-imex running on every node of
# the domain, channel device created); without it the first fabric-handle import fails deep
# inside NCCL or the fused tail.
check_imex() {
  [[ "${LATENTSERVE_REQUIRE_IMEX:-0}" == 1 ]] || return 0
  if dry_run; then echo "check /dev/nvidia-caps-imex-channels/channel*"; return 0; fi
  compgen -G '/dev/nvidia-caps-imex-channels/channel*' >/dev/null \
    || die "no IMEX channel under /dev/nvidia-caps-imex-channels: start nvidia-imex on every node of the NVLink domain and create channel0 (see deploy/README.md)"
}

run() {
  echo "+ $(printf '%q ' "$@")"
  dry_run || "$@"
}

run_exec() {
  echo "+ exec $(printf '%q ' "$@")"
  dry_run && exit 0
  exec "$@"
}
