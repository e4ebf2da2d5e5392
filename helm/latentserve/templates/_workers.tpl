{{/*
The GPU worker group: tp ranks spread over fixed-size pods. replicas, minReplicas and
maxReplicas are equal: a TP group is all or nothing, so the autoscaler must not resize it.
Arguments: root, topology ({pods, gpusPerPod}), modelVolumes, modelMounts.
*/}}
{{- define "latentserve.gpuWorkerGroup" -}}
{{- $root := .root -}}
{{- $v := $root.Values.worker -}}
{{- $pods := int .topology.pods -}}
{{- $gpus := int .topology.gpusPerPod -}}
{{- $mnnvl := $root.Values.mnnvl -}}
{{- $resources := deepCopy ($v.resources | default dict) -}}
{{- $limits := deepCopy (get $resources "limits" | default dict) -}}
{{- $_ := set $limits $v.gpuResourceName $gpus -}}
{{- $_ := set $resources "limits" $limits -}}
{{- if hasKey $resources "requests" -}}
{{- $requests := deepCopy (get $resources "requests" | default dict) -}}
{{- $_ := set $requests $v.gpuResourceName $gpus -}}
{{- $_ := set $resources "requests" $requests -}}
{{- end -}}
{{- if $mnnvl.enabled -}}
{{- $_ := set $resources "claims" (list (dict "name" "imex-channel")) -}}
{{- end -}}
{{- $affinity := deepCopy ($v.affinity | default dict) -}}
{{- if and $mnnvl.enabled $mnnvl.cliqueTopologyKey -}}
{{- $selector := dict "matchLabels" (dict "ray.io/cluster" (include "latentserve.fullname" $root) "ray.io/group" $v.groupName) -}}
{{- $term := dict "labelSelector" $selector "topologyKey" $mnnvl.cliqueTopologyKey -}}
{{- $podAffinity := deepCopy (get $affinity "podAffinity" | default dict) -}}
{{- $required := get $podAffinity "requiredDuringSchedulingIgnoredDuringExecution" | default list -}}
{{- $_ := set $podAffinity "requiredDuringSchedulingIgnoredDuringExecution" (append $required $term) -}}
{{- $_ := set $affinity "podAffinity" $podAffinity -}}
{{- end -}}
- groupName: {{ $v.groupName }}
  replicas: {{ $pods }}
  minReplicas: {{ $pods }}
  maxReplicas: {{ $pods }}
  numOfHosts: 1
  rayStartParams:
    {{- include "latentserve.rayStartParams" $v.rayStartParams | nindent 4 }}
  template:
    metadata:
      labels:
        {{- include "latentserve.labels" $root | nindent 8 }}
        {{- with $v.labels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $v.annotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.serviceAccountName }}
      serviceAccountName: {{ . }}
      {{- end }}
      {{- with $v.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      {{- with $v.podSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: ray-worker
          image: {{ include "latentserve.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["/bin/bash", "-c", "--"]
          args:
            - |-
              {{- include "latentserve.workerScript" $root | nindent 14 }}
          {{- with concat $root.Values.common.containerEnv $v.containerEnv }}
          env:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- with $v.envFrom }}
          envFrom:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          resources:
            {{- toYaml $resources | nindent 12 }}
          {{- with $v.securityContext }}
          securityContext:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- with concat .modelMounts $v.volumeMounts }}
          volumeMounts:
            {{- toYaml . | nindent 12 }}
          {{- end }}
      {{- with concat .modelVolumes $v.volumes }}
      volumes:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- if $mnnvl.enabled }}
      resourceClaims:
        - name: imex-channel
          resourceClaimTemplateName: {{ include "latentserve.imexClaimTemplateName" $root }}
      {{- end }}
      {{- with $v.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end -}}

{{/*
A plain Ray worker group from additionalWorkerGroups (no GPUs or model mount implied).
Arguments: root, name, group.
*/}}
{{- define "latentserve.rayWorkerGroup" -}}
{{- $root := .root -}}
{{- $g := .group -}}
{{- $replicas := int ($g.replicas | default 1) -}}
- groupName: {{ .name }}
  replicas: {{ $replicas }}
  minReplicas: {{ int ($g.minReplicas | default $replicas) }}
  maxReplicas: {{ int ($g.maxReplicas | default $replicas) }}
  numOfHosts: 1
  rayStartParams:
    {{- include "latentserve.rayStartParams" $g.rayStartParams | nindent 4 }}
  template:
    metadata:
      labels:
        {{- include "latentserve.labels" $root | nindent 8 }}
        {{- with $g.labels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $g.annotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $g.podSecurityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: ray-worker
          image: {{ include "latentserve.image" $root }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          command: ["/bin/bash", "-c", "--"]
          args:
            - |-
              {{- include "latentserve.rayWorkerScript" $root | nindent 14 }}
          {{- with concat $root.Values.common.containerEnv ($g.containerEnv | default list) }}
          env:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- with $g.resources }}
          resources:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- with $g.volumeMounts }}
          volumeMounts:
            {{- toYaml . | nindent 12 }}
          {{- end }}
      {{- with $g.volumes }}
      volumes:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $g.nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $g.tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $g.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end -}}
