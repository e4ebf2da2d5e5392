{{/*
Container start scripts. The RayCluster carries ray.io/overwrite-container-cmd: "true", so
KubeRay runs these as given and hands its generated `ray start ...` in
$KUBERAY_GEN_RAY_START_CMD (KubeRay >= 1.1). eval keeps any quoting KubeRay put in it.
*/}}

{{/*
Head: start Ray, then run the controller in the foreground as the container's main process,
so the pod lives and dies with it and its probes judge the service. KubeRay always adds
--block to the generated command; the head strips it so `ray start` returns.
*/}}
{{- define "latentserve.headScript" -}}
set -euo pipefail
ulimit -n "${RAY_START_ULIMIT_OPEN_FILES:-65536}"
: "${KUBERAY_GEN_RAY_START_CMD:?not set: the chart needs KubeRay >= 1.1}"
eval "${KUBERAY_GEN_RAY_START_CMD//--block/}"
exec latentserve serve {{ include "latentserve.shellWords" (include "latentserve.serveArgs" . | fromJsonArray) }}
{{- end -}}

{{/*
GPU worker: the generated `ray start --block` is the main process. With multi-node NVLink
the pod must hold an IMEX channel (from the ComputeDomain claim) before any rank maps a
peer's memory through a fabric handle: fail early and say so.
*/}}
{{- define "latentserve.workerScript" -}}
set -euo pipefail
ulimit -n "${RAY_START_ULIMIT_OPEN_FILES:-65536}"
: "${KUBERAY_GEN_RAY_START_CMD:?not set: the chart needs KubeRay >= 1.1}"
{{- if .Values.mnnvl.enabled }}
if ! ls /dev/nvidia-caps-imex-channels/channel* >/dev/null 2>&1; then
  echo "latentserve: no IMEX channel in /dev/nvidia-caps-imex-channels: is the NVIDIA DRA driver's ComputeDomain claim bound?" >&2
  exit 1
fi
{{- end }}
eval "exec ${KUBERAY_GEN_RAY_START_CMD}"
{{- end -}}

{{/* Plain Ray worker (additionalWorkerGroups). */}}
{{- define "latentserve.rayWorkerScript" -}}
set -euo pipefail
ulimit -n "${RAY_START_ULIMIT_OPEN_FILES:-65536}"
: "${KUBERAY_GEN_RAY_START_CMD:?not set: the chart needs KubeRay >= 1.1}"
eval "exec ${KUBERAY_GEN_RAY_START_CMD}"
{{- end -}}
