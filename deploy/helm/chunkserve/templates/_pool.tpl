{{/*
_pool.tpl: one worker pool (prefill or decode) from the shared pool values
shape: Deployment, headless Service (the routers' DNS discovery), PDB, and the
pool's autoscaler (KEDA ScaledObject or HPA, never both). Called from
pools.yaml with dict "root" $ "role" "prefill"|"decode".
What a pool scales on (docs/deploy.md), autoscaling.signal:
- queue (default): prefill on its queued prefill tokens, decode on KV page usage
  and on the routers' waiting requests;
- predictive: the routers' leading signal, chunkserve:pool_replicas_wanted
  {role} (token rates over measured capacity); decode keeps KV page usage and
  the routers' waiting requests beside it (pages, not rates, refuse work, and a
  decode pool without a step-time target reports no decode capacity).
*/}}
{{- define "chunkserve.pool" -}}
{{- $root := .root }}
{{- $role := .role }}
{{- $p := index $root.Values $role }}
{{- $name := printf "%s-%s" (include "chunkserve.fullname" $root) $role }}
{{- $ctx := dict "root" $root "component" $role }}
{{- $as := $p.autoscaling }}
{{- include "chunkserve.checkGrace" (dict "c" $p "name" $role) }}
{{- if and (eq $root.Values.router.discovery "dns") (lt (mul (int64 $p.preStopSleepSeconds) 1000) (int64 (index $root.Values.router.config "dns-refresh-ms" | default 5000))) }}
{{- fail (printf "%s.preStopSleepSeconds (%d s) is shorter than the router's dns-refresh-ms: a terminating worker could still be in a router's DNS view when it gets SIGTERM" $role (int64 $p.preStopSleepSeconds)) }}
{{- end }}
{{- if and $as.enabled (not $root.Values.monitoring.enabled) }}
{{- fail (printf "%s.autoscaling.enabled needs monitoring.enabled: the autoscaling queries select series by the namespace/release/component labels the chart's PodMonitor or ServiceMonitor adds" $role) }}
{{- end }}
{{- $ports := list $p.ports.grpc $p.ports.ops }}
{{- if eq $role "decode" }}{{ $ports = append $ports $p.ports.kv }}{{ end }}
{{- $set := list "POD_IP" "POD_NAME" "CHUNKSERVE_MODEL" "CHUNKSERVE_HOST" "CHUNKSERVE_PORT" "CHUNKSERVE_HTTP_HOST" "CHUNKSERVE_HTTP_PORT" "CHUNKSERVE_WORKER_ID" "CHUNKSERVE_CLUSTER_SECRET_FILE" "CHUNKSERVE_TLS_CERT_FILE" "CHUNKSERVE_TLS_KEY_FILE" "CHUNKSERVE_TLS_CLIENT_CA_FILE" "CHUNKSERVE_KV_HOST" "CHUNKSERVE_KV_PORT" "CHUNKSERVE_KV_ADVERTISE" "CHUNKSERVE_DECODE_WORKERS" "CHUNKSERVE_DECODE_DNS" "CHUNKSERVE_WORKER_TLS_CA_FILE" "CHUNKSERVE_WORKER_TLS_CERT_FILE" "CHUNKSERVE_WORKER_TLS_KEY_FILE" "CHUNKSERVE_WORKER_TLS_SERVER_NAME" "CHUNKSERVE_BACKEND" "CUDA_CACHE_PATH" "NCCL_SOCKET_IFNAME" "NCCL_DEBUG" }}
{{- include "chunkserve.checkContainer" (dict "c" $p "name" $role "ports" $ports "set" $set) }}
{{- if and $p.gpu.enabled (not (hasKey ($p.resources.limits | default dict) "nvidia.com/gpu")) }}
{{- fail (printf "%s.gpu.enabled needs resources.limits.nvidia.com/gpu" $role) }}
{{- end }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "chunkserve.labels" $ctx | nindent 4 }}
spec:
  {{- if not $as.enabled }}
  replicas: {{ int64 $p.replicas }}
  {{- end }}
  revisionHistoryLimit: 3
  strategy:
    {{- include "chunkserve.strategy" (dict "c" $p "gpu" $p.gpu.enabled "name" $role) | trim | nindent 4 }}
  selector:
    matchLabels:
      {{- include "chunkserve.selectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      labels:
        {{- include "chunkserve.podLabels" $ctx | nindent 8 }}
        {{- with $p.podLabels }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $p.podAnnotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
    spec:
      {{- include "chunkserve.podCommon" (dict "root" $root "c" $p) | nindent 6 }}
      containers:
        - name: {{ $role }}
          image: {{ include "chunkserve.image" (dict "root" $root "gpu" $p.gpu.enabled) | quote }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args: ["/usr/local/bin/chunkserve-{{ $role }}"]
          securityContext:
            {{- toYaml $root.Values.securityContext | nindent 12 }}
          ports:
            - name: grpc
              containerPort: {{ int64 $p.ports.grpc }}
              protocol: TCP
            - name: ops
              containerPort: {{ int64 $p.ports.ops }}
              protocol: TCP
            {{- if eq $role "decode" }}
            - name: kv
              containerPort: {{ int64 $p.ports.kv }}
              protocol: TCP
            {{- end }}
          env:
            - name: POD_IP
              valueFrom:
                fieldRef:
                  fieldPath: status.podIP
            - name: POD_NAME
              valueFrom:
                fieldRef:
                  fieldPath: metadata.name
            - name: CHUNKSERVE_MODEL
              value: {{ $root.Values.model.path | quote }}
            - name: CHUNKSERVE_HOST
              value: "0.0.0.0"
            - name: CHUNKSERVE_PORT
              value: {{ int64 $p.ports.grpc | toString | quote }}
            - name: CHUNKSERVE_HTTP_HOST
              value: "0.0.0.0"
            - name: CHUNKSERVE_HTTP_PORT
              value: {{ int64 $p.ports.ops | toString | quote }}
            - name: CHUNKSERVE_WORKER_ID
              value: "$(POD_NAME)"
            {{- if $root.Values.clusterSecret.enabled }}
            - name: CHUNKSERVE_CLUSTER_SECRET_FILE
              value: /etc/chunkserve/cluster/cluster-secret
            {{- end }}
            {{- if $root.Values.tls.enabled }}
            - name: CHUNKSERVE_TLS_CERT_FILE
              value: /etc/chunkserve/tls/tls.crt
            - name: CHUNKSERVE_TLS_KEY_FILE
              value: /etc/chunkserve/tls/tls.key
            - name: CHUNKSERVE_TLS_CLIENT_CA_FILE
              value: /etc/chunkserve/tls/ca.crt
            {{- end }}
            {{- if eq $role "decode" }}
            - name: CHUNKSERVE_KV_HOST
              value: "0.0.0.0"
            - name: CHUNKSERVE_KV_PORT
              value: {{ int64 $p.ports.kv | toString | quote }}
            # Prefill workers connect to the pod IP (a headless Service has no virtual IP).
            - name: CHUNKSERVE_KV_ADVERTISE
              value: "$(POD_IP)"
            {{- else }}
            # KV pages go only to the KV endpoints these decode workers advertise.
            {{- if eq $root.Values.router.discovery "static" }}
            - name: CHUNKSERVE_DECODE_WORKERS
              value: {{ join "," $root.Values.router.staticWorkers.decode | quote }}
            {{- else }}
            - name: CHUNKSERVE_DECODE_DNS
              value: {{ printf "%s-decode.%s.svc.%s:%d" (include "chunkserve.fullname" $root) $root.Release.Namespace $root.Values.clusterDomain (int64 $root.Values.decode.ports.grpc) | quote }}
            {{- end }}
            {{- if $root.Values.tls.enabled }}
            - name: CHUNKSERVE_WORKER_TLS_CA_FILE
              value: /etc/chunkserve/tls/ca.crt
            - name: CHUNKSERVE_WORKER_TLS_CERT_FILE
              value: /etc/chunkserve/tls/tls.crt
            - name: CHUNKSERVE_WORKER_TLS_KEY_FILE
              value: /etc/chunkserve/tls/tls.key
            - name: CHUNKSERVE_WORKER_TLS_SERVER_NAME
              value: {{ $root.Values.tls.serverName | quote }}
            {{- end }}
            {{- end }}
            {{- if $p.gpu.enabled }}
            # A pool scheduled on GPUs must fail loudly when none is usable, not fall back to the CPU.
            - name: CHUNKSERVE_BACKEND
              value: "cuda"
            - name: CUDA_CACHE_PATH
              value: "/tmp/cuda-cache"
            {{- with $p.gpu.nccl.socketIfname }}
            - name: NCCL_SOCKET_IFNAME
              value: {{ . | quote }}
            {{- end }}
            - name: NCCL_DEBUG
              value: {{ $p.gpu.nccl.debug | quote }}
            {{- range $k, $v := $p.gpu.nccl.env }}
            - name: {{ $k }}
              value: {{ include "chunkserve.scalar" $v | quote }}
            {{- end }}
            {{- else }}
            - name: CHUNKSERVE_BACKEND
              value: "cpu"
            {{- end }}
            {{- with $p.config }}
            {{- include "chunkserve.configEnv" . | trim | nindent 12 }}
            {{- end }}
            {{- with $p.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- include "chunkserve.probes" $p.probes | nindent 10 }}
          {{- include "chunkserve.lifecycle" $p | nindent 10 }}
          resources:
            {{- toYaml $p.resources | nindent 12 }}
          {{- include "chunkserve.volumeMounts" (dict "root" $root "c" $p) | nindent 10 }}
      {{- include "chunkserve.volumes" (dict "root" $root "c" $p) | nindent 6 }}
---
# Headless: one DNS A record per ready pod; the routers resolve it every
# dns-refresh-ms (--{{ $role }}-dns {{ $name }}...:{{ int64 $p.ports.grpc }}).
apiVersion: v1
kind: Service
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "chunkserve.labels" $ctx | nindent 4 }}
spec:
  clusterIP: None
  publishNotReadyAddresses: false
  selector:
    {{- include "chunkserve.selectorLabels" $ctx | nindent 4 }}
  ports:
    - name: grpc
      port: {{ int64 $p.ports.grpc }}
      targetPort: grpc
      protocol: TCP
    - name: ops
      port: {{ int64 $p.ports.ops }}
      targetPort: ops
      protocol: TCP
    {{- if eq $role "decode" }}
    - name: kv
      port: {{ int64 $p.ports.kv }}
      targetPort: kv
      protocol: TCP
    {{- end }}
{{- if $p.pdb.enabled }}
---
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "chunkserve.labels" $ctx | nindent 4 }}
spec:
  maxUnavailable: {{ $p.pdb.maxUnavailable }}
  # a pod that is not Ready (crash-looping, stuck loading) may always be evicted:
  # it serves nothing, and keeping it must not block a node drain
  unhealthyPodEvictionPolicy: {{ $p.pdb.unhealthyPodEvictionPolicy }}
  selector:
    matchLabels:
      {{- include "chunkserve.selectorLabels" $ctx | nindent 6 }}
{{- end }}
{{- if $as.enabled }}
{{- if gt (int64 $as.minReplicas) (int64 $as.maxReplicas) }}
{{- fail (printf "%s.autoscaling.minReplicas (%d) > maxReplicas (%d)" $role (int64 $as.minReplicas) (int64 $as.maxReplicas)) }}
{{- end }}
{{- $sel := include "chunkserve.promSelector" $ctx }}
{{- $routerSel := include "chunkserve.promSelector" (dict "root" $root "component" "router") }}
{{- /* target queued prefill tokens per replica = tokens/s of one replica x seconds of backlog allowed */}}
{{- $prefillTarget := mulf $as.prefillTokensPerSecond $as.backlogSeconds | ceil | int64 }}
{{- $behavior := include "chunkserve.behavior" $as }}
---
{{- if eq $as.engine "keda" }}
apiVersion: keda.sh/v1alpha1
kind: ScaledObject
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "chunkserve.labels" $ctx | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ $name }}
  pollingInterval: {{ int64 $as.pollingIntervalSeconds }}
  minReplicaCount: {{ int64 $as.minReplicas }}
  maxReplicaCount: {{ int64 $as.maxReplicas }}
  {{- if $as.fallback.enabled }}
  # Prometheus unreachable (or a query failing) failureThreshold times in a row:
  # {{ $as.fallback.replicas | default $as.minReplicas | int64 }} replica(s), {{ $as.fallback.behavior }}; not a guess from no data
  fallback:
    failureThreshold: {{ int64 $as.fallback.failureThreshold }}
    replicas: {{ $as.fallback.replicas | default $as.minReplicas | int64 }}
    behavior: {{ $as.fallback.behavior }}
  {{- end }}
  advanced:
    horizontalPodAutoscalerConfig:
      behavior:
        {{- $behavior | nindent 8 }}
  triggers:
    {{- if eq $as.signal "predictive" }}
    # desired = ceil(the routers' sum of the replicas this pool needs for their traffic: token
    # rates over one replica's measured capacity, and their backlog; router/demand.h)
    {{- include "chunkserve.promTrigger" (dict "root" $root "name" "replicas-wanted" "query" (printf "sum(chunkserve:pool_replicas_wanted{%s,role=\"%s\"})" $routerSel $role) "threshold" "1") }}
    {{- else if eq $role "prefill" }}
    # desired = ceil(sum of queued prefill tokens / {{ $prefillTarget }}), {{ $prefillTarget }} = prefillTokensPerSecond x backlogSeconds
    {{- include "chunkserve.promTrigger" (dict "root" $root "name" "queued-prefill-tokens" "query" (printf "sum(chunkserve:queued_prefill_tokens{%s})" $sel) "threshold" ($prefillTarget | toString)) }}
    {{- end }}
    {{- if eq $role "decode" }}
    # desired = ceil(sum of KV page usage fractions / {{ include "chunkserve.scalar" $as.kvCacheUsageTarget }})
    {{- include "chunkserve.promTrigger" (dict "root" $root "name" "kv-cache-usage" "query" (printf "sum(chunkserve:kv_cache_usage_perc{%s})" $sel) "threshold" (include "chunkserve.scalar" $as.kvCacheUsageTarget)) }}
    {{- end }}
    {{- if eq $role "decode" }}
    # desired = ceil(requests waiting in the routers / {{ include "chunkserve.scalar" $as.waitingRequestsPerReplica }})
    {{- include "chunkserve.promTrigger" (dict "root" $root "name" "router-requests-waiting" "query" (printf "sum(chunkserve:num_requests_waiting{%s})" $routerSel) "threshold" (include "chunkserve.scalar" $as.waitingRequestsPerReplica)) }}
    {{- end }}
{{- else }}
apiVersion: autoscaling/v2
kind: HorizontalPodAutoscaler
metadata:
  name: {{ $name }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "chunkserve.labels" $ctx | nindent 4 }}
spec:
  scaleTargetRef:
    apiVersion: apps/v1
    kind: Deployment
    name: {{ $name }}
  minReplicas: {{ int64 $as.minReplicas }}
  maxReplicas: {{ int64 $as.maxReplicas }}
  behavior:
    {{- $behavior | nindent 4 }}
  metrics:
    {{- if eq $as.signal "predictive" }}
    # the routers' chunkserve:pool_replicas_wanted{role="{{ $role }}"} (an External metric: the
    # series belong to the router pods), summed: the replicas this pool needs (router/demand.h)
    - type: External
      external:
        metric:
          name: chunkserve_pool_replicas_wanted
          selector:
            matchLabels:
              release: {{ $root.Release.Name }}
              component: router
              role: {{ $role }}
        target:
          type: AverageValue
          averageValue: "1"
    {{- else if eq $role "prefill" }}
    # chunkserve:queued_prefill_tokens per pod, via prometheus-adapter (adapter-rules.yaml renames ':' to '_')
    - type: Pods
      pods:
        metric:
          name: chunkserve_queued_prefill_tokens
        target:
          type: AverageValue
          averageValue: {{ $prefillTarget | toString | quote }}
    {{- end }}
    {{- if eq $role "decode" }}
    - type: Pods
      pods:
        metric:
          name: chunkserve_kv_cache_usage_perc
        target:
          type: AverageValue
          averageValue: {{ round (mulf $as.kvCacheUsageTarget 1000) 0 | int64 | printf "%dm" | quote }}
    {{- end }}
    {{- if eq $role "decode" }}
    # the routers' queue (an External metric: the series belong to the router pods, not this pool)
    - type: External
      external:
        metric:
          name: chunkserve_num_requests_waiting
          selector:
            matchLabels:
              release: {{ $root.Release.Name }}
              component: router
        target:
          type: AverageValue
          averageValue: {{ include "chunkserve.scalar" $as.waitingRequestsPerReplica | quote }}
    {{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/* One KEDA prometheus trigger: dict "root" $ "name" NAME "query" PROMQL "threshold" TEXT. */}}
{{- define "chunkserve.promTrigger" }}
    - type: prometheus
      name: {{ .name }}
      metricType: AverageValue
      {{- with .root.Values.prometheus.authenticationRef.name }}
      authenticationRef:
        name: {{ . }}
        kind: {{ $.root.Values.prometheus.authenticationRef.kind }}
      {{- end }}
      metadata:
        serverAddress: {{ .root.Values.prometheus.serverAddress | quote }}
        {{- with .root.Values.prometheus.authModes }}
        authModes: {{ . | quote }}
        {{- end }}
        {{- if .root.Values.prometheus.unsafeSsl }}
        unsafeSsl: "true"
        {{- end }}
        query: {{ .query | quote }}
        threshold: {{ .threshold | quote }}
{{- end }}

{{/* HPA behavior (also KEDA's advanced.horizontalPodAutoscalerConfig.behavior):
scale up at once (no window; double or +N pods per period, whichever is more),
scale down only after the stabilization window, a few pods per period. */}}
{{- define "chunkserve.behavior" -}}
scaleUp:
  stabilizationWindowSeconds: 0
  selectPolicy: Max
  policies:
    - type: Percent
      value: 100
      periodSeconds: 15
    - type: Pods
      value: {{ int64 .scaleUpPods }}
      periodSeconds: 15
scaleDown:
  stabilizationWindowSeconds: {{ int64 .scaleDownStabilizationSeconds }}
  selectPolicy: Min
  policies:
    - type: Pods
      value: {{ int64 .scaleDownPods }}
      periodSeconds: {{ int64 .scaleDownPeriodSeconds }}
{{- end }}
