{{/* vim: set filetype=mustache: */}}
{{/*
Names, following KubeRay's ray-cluster chart: <release>-<chart> truncated to 63 characters,
or the release name alone when it already contains the chart name.
*/}}
{{- define "latentserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "latentserve.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "latentserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "latentserve.labels" -}}
app.kubernetes.io/name: {{ include "latentserve.name" . }}
helm.sh/chart: {{ include "latentserve.chart" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The labels KubeRay puts on the head pod: the API Service selects on them. */}}
{{- define "latentserve.headSelector" -}}
ray.io/cluster: {{ include "latentserve.fullname" . }}
ray.io/node-type: head
{{- end -}}

{{- define "latentserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) -}}
{{- end -}}

{{/* The Secret holding the admin key, or "" when the admin API is off. */}}
{{- define "latentserve.adminSecretName" -}}
{{- $key := .Values.latentserve.adminKey -}}
{{- if $key.existingSecret -}}
{{- $key.existingSecret -}}
{{- else if $key.create -}}
{{- printf "%s-admin-key" (include "latentserve.fullname" .) -}}
{{- end -}}
{{- end -}}

{{- define "latentserve.computeDomainName" -}}
{{- .Values.mnnvl.computeDomain.name | default (printf "%s-domain" (include "latentserve.fullname" .)) -}}
{{- end -}}

{{- define "latentserve.imexClaimTemplateName" -}}
{{- $cd := .Values.mnnvl.computeDomain -}}
{{- if and (not $cd.create) (not $cd.resourceClaimTemplateName) -}}
{{- fail "mnnvl.computeDomain.create=false needs mnnvl.computeDomain.resourceClaimTemplateName (the existing ComputeDomain's channel claim template)" -}}
{{- end -}}
{{- $cd.resourceClaimTemplateName | default (printf "%s-imex-channel" (include "latentserve.fullname" .)) -}}
{{- end -}}

{{/*
Worker topology as JSON {"pods": N, "gpusPerPod": G}: tp ranks, one GPU each, packed
gpusPerNode to a pod. A TP group that does not fill whole nodes cannot be placed evenly.
*/}}
{{- define "latentserve.workerTopology" -}}
{{- $tp := int .Values.latentserve.tp -}}
{{- $gpn := int .Values.latentserve.gpusPerNode -}}
{{- if lt $tp 1 -}}{{- fail "latentserve.tp must be >= 1" -}}{{- end -}}
{{- if lt $gpn 1 -}}{{- fail "latentserve.gpusPerNode must be >= 1" -}}{{- end -}}
{{- if le $tp $gpn -}}
{{- dict "pods" 1 "gpusPerPod" $tp | toJson -}}
{{- else if ne (mod $tp $gpn) 0 -}}
{{- fail (printf "latentserve.tp=%d is not a multiple of latentserve.gpusPerNode=%d: the TP ranks must fill whole worker pods" $tp $gpn) -}}
{{- else -}}
{{- dict "pods" (div $tp $gpn) "gpusPerPod" $gpn | toJson -}}
{{- end -}}
{{- end -}}

{{/*
The --model argument: a preset name, or an absolute path inside the mounted model source.
Keep the preset list equal to service/config.py PRESETS (tests/test_helm_chart.py checks).
*/}}
{{- define "latentserve.presets" -}}
{{- list "tiny" "tiny-dense-moe" "small" "k3-tiny" "k3" | toJson -}}
{{- end -}}

{{- define "latentserve.modelArg" -}}
{{- $model := required "latentserve.model is required" .Values.latentserve.model | toString -}}
{{- $src := .Values.modelSource -}}
{{- if hasPrefix "/" $model -}}
{{- if eq $src.type "none" -}}
{{- fail (printf "latentserve.model=%s is a path but modelSource.type is none: mount a pvc or hostPath" $model) -}}
{{- end -}}
{{- if not (hasPrefix (printf "%s/" (trimSuffix "/" $src.mountPath)) $model) -}}
{{- fail (printf "latentserve.model=%s is not under modelSource.mountPath=%s" $model $src.mountPath) -}}
{{- end -}}
{{- else if not (has $model (include "latentserve.presets" . | fromJsonArray)) -}}
{{- fail (printf "latentserve.model=%s is neither a preset %s nor an absolute path under modelSource.mountPath" $model (include "latentserve.presets" .)) -}}
{{- end -}}
{{- $model -}}
{{- end -}}

{{/* argv of `latentserve serve` on the head, as a JSON list. */}}
{{- define "latentserve.serveArgs" -}}
{{- $ls := .Values.latentserve -}}
{{- $args := list "--ray-address" "auto" "--host" "0.0.0.0" "--port" (toString (int $ls.port)) -}}
{{- $args = concat $args (list "--model" (include "latentserve.modelArg" .) "--tp" (toString (int $ls.tp))) -}}
{{- $args = concat $args (list "--device" $ls.device "--dtype" $ls.dtype "--fused-tail" $ls.fusedTail) -}}
{{- with $ls.hfOverrides -}}
{{- $args = concat $args (list "--hf-overrides" (toJson .)) -}}
{{- end -}}
{{- with $ls.maxModelLen -}}
{{- $args = concat $args (list "--max-model-len" (toString (int .))) -}}
{{- end -}}
{{- with $ls.servedModelName -}}
{{- $args = concat $args (list "--served-model-name" .) -}}
{{- end -}}
{{- if $ls.sleepMode.enabled -}}
{{- $args = append $args "--enable-sleep-mode" -}}
{{- with $ls.sleepMode.preserveParameterNames -}}
{{- $args = concat $args (list "--sleep-preserve-parameter-names") . -}}
{{- end -}}
{{- else if $ls.sleepMode.preserveParameterNames -}}
{{- fail "latentserve.sleepMode.preserveParameterNames needs latentserve.sleepMode.enabled" -}}
{{- end -}}
{{- range $ls.extraArgs -}}
{{- $args = append $args (toString .) -}}
{{- end -}}
{{- $args | toJson -}}
{{- end -}}

{{/* A list of words as single-quoted shell words; a word holding a quote is refused. */}}
{{- define "latentserve.shellWords" -}}
{{- $words := list -}}
{{- range . -}}
{{- if contains "'" . -}}
{{- fail (printf "argument %s contains a single quote, which the head's start script cannot carry" .) -}}
{{- end -}}
{{- $words = append $words (squote .) -}}
{{- end -}}
{{- join " " $words -}}
{{- end -}}

{{/* Volumes and mounts of the model source, for head and workers alike (JSON lists). */}}
{{- define "latentserve.modelVolumes" -}}
{{- $src := .Values.modelSource -}}
{{- $volumes := list -}}
{{- if eq $src.type "pvc" -}}
{{- $claim := required "modelSource.pvc.claimName is required with modelSource.type=pvc" $src.pvc.claimName -}}
{{- $volumes = append $volumes (dict "name" "model" "persistentVolumeClaim" (dict "claimName" $claim "readOnly" $src.readOnly)) -}}
{{- else if eq $src.type "hostPath" -}}
{{- $path := required "modelSource.hostPath.path is required with modelSource.type=hostPath" $src.hostPath.path -}}
{{- $volumes = append $volumes (dict "name" "model" "hostPath" (dict "path" $path "type" ($src.hostPath.type | default "Directory"))) -}}
{{- else if ne $src.type "none" -}}
{{- fail (printf "modelSource.type=%s: use none, pvc or hostPath" $src.type) -}}
{{- end -}}
{{- $volumes | toJson -}}
{{- end -}}

{{- define "latentserve.modelVolumeMounts" -}}
{{- $mounts := list -}}
{{- if ne .Values.modelSource.type "none" -}}
{{- $mounts = append $mounts (dict "name" "model" "mountPath" .Values.modelSource.mountPath "readOnly" .Values.modelSource.readOnly) -}}
{{- end -}}
{{- $mounts | toJson -}}
{{- end -}}

{{/* rayStartParams as a map of strings (KubeRay's type), "{}" when empty. */}}
{{- define "latentserve.rayStartParams" -}}
{{- $params := dict -}}
{{- range $key, $val := . -}}
{{- $_ := set $params $key (toString $val) -}}
{{- end -}}
{{- toYaml $params -}}
{{- end -}}
