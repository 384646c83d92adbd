{{/*
_helpers.tpl: names, labels, the image, config-to-env rendering and the
render-time checks (scale-in arithmetic, discovery) shared by the router and
the two pools. The pool objects themselves are in _pool.tpl.
*/}}

{{- define "chunkserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Release-scoped base name; component names append -router/-prefill/-decode (<= 63). */}}
{{- define "chunkserve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "chunkserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every object. Argument: dict "root" $ "component" NAME. */}}
{{- define "chunkserve.labels" -}}
helm.sh/chart: {{ include "chunkserve.chart" .root }}
{{ include "chunkserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: chunkserve
{{- end }}

{{/* Labels of pod templates: no chart version and no app version (a
chart-only bump must not restart every pod: on GPUs, a model reload each);
the image reference already changes the template when the software does.
Argument: dict "root" $ "component" NAME. */}}
{{- define "chunkserve.podLabels" -}}
{{ include "chunkserve.selectorLabels" . }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: chunkserve
{{- end }}

{{/* Selector labels: name, release, component. The PodMonitor turns the
component label into the `component` series label. */}}
{{- define "chunkserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "chunkserve.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* Labels shared by every pod of the release (NetworkPolicy peers, monitors). */}}
{{- define "chunkserve.releaseLabels" -}}
app.kubernetes.io/name: {{ include "chunkserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The image of a component. Argument: dict "root" $ "gpu" BOOL. A
mutable tag (latest) is refused: a rollout could not tell versions apart
and pods of one Deployment could run different software. */}}
{{- define "chunkserve.image" -}}
{{- $img := .root.Values.image }}
{{- if or (eq $img.tag "latest") (eq $img.cuda.tag "latest") }}
{{- fail "image.tag / image.cuda.tag \"latest\" is refused: pin a version (or a digest) so that a rollout changes the pods and every pod of a pool runs the same build" }}
{{- end }}
{{- if .gpu }}
{{- printf "%s:%s" $img.cuda.repository (default .root.Chart.AppVersion $img.cuda.tag) }}
{{- else }}
{{- printf "%s:%s" $img.repository (default .root.Chart.AppVersion $img.tag) }}
{{- end }}
{{- end }}

{{/* A scalar as the text a CHUNKSERVE_* variable carries. Helm reads every
number in a values file as float64, which %v would print as 1e+06: whole
numbers are printed as integers. */}}
{{- define "chunkserve.scalar" -}}
{{- if or (kindIs "float64" .) (kindIs "float32" .) }}
{{- if eq (floor .) (float64 .) }}{{ printf "%d" (int64 .) }}{{ else }}{{ printf "%v" . }}{{ end }}
{{- else }}
{{- printf "%v" . }}
{{- end }}
{{- end }}

{{/* flag name -> CHUNKSERVE_* variable name (the processes' own rule). */}}
{{- define "chunkserve.envName" -}}
{{- printf "CHUNKSERVE_%s" (. | upper | replace "-" "_") }}
{{- end }}

{{/* The `config:` map of a component as env entries, sorted by flag. */}}
{{- define "chunkserve.configEnv" -}}
{{- range $flag, $value := . }}
- name: {{ include "chunkserve.envName" $flag }}
  value: {{ include "chunkserve.scalar" $value | quote }}
{{- end }}
{{- end }}

{{/* The grace a process gets after SIGTERM, in whole seconds (rounded up),
from its `config.grace-ms` or the processes' default of 5000 ms. */}}
{{- define "chunkserve.graceSeconds" -}}
{{- $ms := 5000 }}
{{- if hasKey .config "grace-ms" }}{{ $ms = index .config "grace-ms" }}{{ end }}
{{- div (add (int64 $ms) 999) 1000 }}
{{- end }}

{{/* Scale-in arithmetic: the pod must outlive the preStop sleep, the process's
drain (grace-ms) and a margin for the RPC server's own backstop and teardown;
otherwise the kubelet's SIGKILL cuts streams the drain was about to finish.
Argument: dict "c" COMPONENT_VALUES "name" NAME. */}}
{{- define "chunkserve.checkGrace" -}}
{{- $grace := include "chunkserve.graceSeconds" .c | int64 }}
{{- $need := add (int64 .c.preStopSleepSeconds) $grace (int64 .c.graceMarginSeconds) }}
{{- if lt (int64 .c.terminationGracePeriodSeconds) $need }}
{{- fail (printf "%s: terminationGracePeriodSeconds %d is too short: it must be at least preStopSleepSeconds (%d) + config.grace-ms rounded up to seconds (%d) + graceMarginSeconds (%d) = %d" .name (int64 .c.terminationGracePeriodSeconds) (int64 .c.preStopSleepSeconds) $grace (int64 .c.graceMarginSeconds) $need) }}
{{- end }}
{{- end }}

{{/* Pod-level settings shared by every component. Argument: dict "root" $ "c" COMPONENT_VALUES. */}}
{{- define "chunkserve.podCommon" -}}
automountServiceAccountToken: false
enableServiceLinks: false
terminationGracePeriodSeconds: {{ int64 .c.terminationGracePeriodSeconds }}
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .c.priorityClassName }}
priorityClassName: {{ . }}
{{- end }}
{{- with .c.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .c.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .c.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .c.topologySpreadConstraints }}
topologySpreadConstraints:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* Probes on the ops port: startup (model load, up to periodSeconds x
failureThreshold), liveness on /healthz, readiness on /readyz. */}}
{{- define "chunkserve.probes" -}}
startupProbe:
  httpGet:
    path: /healthz
    port: ops
  periodSeconds: {{ .startup.periodSeconds }}
  timeoutSeconds: {{ .startup.timeoutSeconds }}
  failureThreshold: {{ .startup.failureThreshold }}
livenessProbe:
  httpGet:
    path: /healthz
    port: ops
  periodSeconds: {{ .liveness.periodSeconds }}
  timeoutSeconds: {{ .liveness.timeoutSeconds }}
  failureThreshold: {{ .liveness.failureThreshold }}
readinessProbe:
  httpGet:
    path: /readyz
    port: ops
  periodSeconds: {{ .readiness.periodSeconds }}
  timeoutSeconds: {{ .readiness.timeoutSeconds }}
  failureThreshold: {{ .readiness.failureThreshold }}
{{- end }}

{{/* preStop: keep serving while the endpoint leaves the Service (and the
routers' DNS view); SIGTERM follows. exec sleep works on every Kubernetes
version the chart supports (the `sleep` lifecycle action needs 1.30+). */}}
{{- define "chunkserve.lifecycle" -}}
lifecycle:
  preStop:
    exec:
      command: ["/bin/sleep", {{ int64 .preStopSleepSeconds | toString | quote }}]
{{- end }}

{{/* Volume mounts every container has: the model (read-only, when a volume
is given), /dev/shm and a writable /tmp (the root filesystem is read-only),
the secrets, then the component's extraVolumeMounts (e.g. a Secret for
--api-key-file). Argument: dict "root" $ "c" COMPONENT_VALUES. */}}
{{- define "chunkserve.volumeMounts" -}}
volumeMounts:
  - name: tmp
    mountPath: /tmp
  - name: dshm
    mountPath: /dev/shm
{{- if .root.Values.model.volume }}
  - name: model
    mountPath: {{ .root.Values.model.mountPath }}
    readOnly: true
{{- end }}
{{- if .root.Values.clusterSecret.enabled }}
  - name: cluster-secret
    mountPath: /etc/chunkserve/cluster
    readOnly: true
{{- end }}
{{- if .root.Values.tls.enabled }}
  - name: tls
    mountPath: /etc/chunkserve/tls
    readOnly: true
{{- end }}
{{- with .c.extraVolumeMounts }}
{{ toYaml . | indent 2 }}
{{- end }}
{{- end }}

{{/* The Secret holding the cluster secret (key cluster-secret): always the user's. */}}
{{- define "chunkserve.clusterSecretName" -}}
{{- .Values.clusterSecret.existingSecret }}
{{- end }}

{{/* The Secret holding the public API key: the user's, or the one secret.yaml makes. */}}
{{- define "chunkserve.apiKeySecretName" -}}
{{- .Values.apiKey.existingSecret | default (printf "%s-api-key" (include "chunkserve.fullname" .)) }}
{{- end }}


{{- define "chunkserve.volumes" -}}
volumes:
  - name: tmp
    emptyDir: {}
  - name: dshm
    emptyDir:
      medium: Memory
      {{- with .c.shmSizeLimit }}
      sizeLimit: {{ . }}
      {{- end }}
{{- with .root.Values.model.volume }}
  - name: model
    {{- toYaml . | nindent 4 }}
{{- end }}
{{- if .root.Values.clusterSecret.enabled }}
  - name: cluster-secret
    secret:
      secretName: {{ include "chunkserve.clusterSecretName" .root }}
      defaultMode: 0400
{{- end }}
{{- if .root.Values.tls.enabled }}
  - name: tls
    secret:
      secretName: {{ .root.Values.tls.secretName }}
      defaultMode: 0400
{{- end }}
{{- with .c.extraVolumes }}
{{ toYaml . | indent 2 }}
{{- end }}
{{- end }}

{{/* Model path checks: a mounted volume must hold the file the processes read. */}}
{{- define "chunkserve.checkModel" -}}
{{- $m := .Values.model }}
{{- if and $m.volume (not (hasPrefix (printf "%s/" (trimSuffix "/" $m.mountPath)) $m.path)) }}
{{- fail (printf "model.path %q is not under model.mountPath %q, where model.volume is mounted" $m.path $m.mountPath) }}
{{- end }}
{{- end }}

{{/* The Prometheus label matchers that select one component's series of this
release: the labels the chart's PodMonitor/ServiceMonitor relabeling adds. */}}
{{- define "chunkserve.promSelector" -}}
{{- printf "namespace=%q,release=%q,component=%q" .root.Release.Namespace .root.Release.Name .component }}
{{- end }}

{{/* The Deployment's rolling update. Argument: dict "c" COMPONENT_VALUES
"gpu" BOOL "name" NAME. Unset values default by hardware: a CPU pool surges
one pod first (maxSurge 1 / maxUnavailable 0); a GPU pool replaces in place
(maxSurge 0 / maxUnavailable 1), because a full GPU fleet has no spare GPU
for a surge pod, which would stay Pending and stall the rollout forever. */}}
{{- define "chunkserve.strategy" -}}
{{- $ru := .c.rollingUpdate | default dict }}
{{- $surge := ternary 0 1 .gpu }}
{{- $unavail := ternary 1 0 .gpu }}
{{- if hasKey $ru "maxSurge" }}{{ $surge = $ru.maxSurge }}{{ end }}
{{- if hasKey $ru "maxUnavailable" }}{{ $unavail = $ru.maxUnavailable }}{{ end }}
{{- if and (has (toString $surge) (list "0" "0%")) (has (toString $unavail) (list "0" "0%")) }}
{{- fail (printf "%s.rollingUpdate: maxSurge and maxUnavailable are both 0: the rollout could never make progress" .name) }}
{{- end }}
type: RollingUpdate
rollingUpdate:
  maxSurge: {{ $surge }}
  maxUnavailable: {{ $unavail }}
{{- end }}

{{/* Render-time checks of one component's container. Argument: dict "c"
COMPONENT_VALUES "name" NAME "ports" LIST "set" LIST (the variables the
chart sets besides config:'s): distinct container ports, no extraEnv entry that replaces a
variable the chart sets (the first would silently win or lose by order),
and GPU requests that agree with gpu.enabled. */}}
{{- define "chunkserve.checkContainer" -}}
{{- $seen := dict }}
{{- range .ports }}
{{- if hasKey $seen (toString .) }}
{{- fail (printf "%s.ports: port %d is used twice: each of gRPC, ops and KV needs its own" $.name (int64 .)) }}
{{- end }}
{{- $_ := set $seen (toString .) true }}
{{- end }}
{{- $set := .set }}
{{- range $flag, $_ := .c.config }}
{{- $set = append $set (include "chunkserve.envName" $flag) }}
{{- end }}
{{- range .c.extraEnv }}
{{- if has .name $set }}
{{- fail (printf "%s.extraEnv sets %s, which the chart sets itself: use the value that drives it (config:, ports, tls, clusterSecret, model)" $.name .name) }}
{{- end }}
{{- end }}
{{- $limits := (.c.resources | default dict).limits | default dict }}
{{- $gpuLimit := hasKey $limits "nvidia.com/gpu" }}
{{- $gpu := and (hasKey .c "gpu") .c.gpu.enabled }}
{{- if and $gpuLimit (not $gpu) }}
{{- fail (printf "%s.resources.limits asks for nvidia.com/gpu but %s.gpu.enabled is false: the pod would hold a GPU and run the CPU image" .name .name) }}
{{- end }}
{{- if and $gpu $gpuLimit (lt (int64 (index $limits "nvidia.com/gpu")) 1) }}
{{- fail (printf "%s.resources.limits.nvidia.com/gpu is %v: gpu.enabled needs at least 1" .name (index $limits "nvidia.com/gpu")) }}
{{- end }}
{{- end }}
