{{/* Names */}}
{{- define "kiw.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kiw.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "kiw.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kiw.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kiw.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kiw.labels" -}}
helm.sh/chart: {{ include "kiw.chart" . }}
{{ include "kiw.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/component: inference-worker
{{- end }}

{{- define "kiw.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kiw.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kiw.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- $variant := ternary "cuda" "cpu" (.Values.gpu.enabled | default false) }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default (printf "%s-%s" .Chart.AppVersion $variant)) }}
{{- end }}
{{- end }}

{{/*
The literal value of an extraEnv entry (name given), or "" when there is none. The worker reads WORKER__ env
over the file, so a setting the chart also needs (port, group, brokers, shutdown budget) follows such an
override. A valueFrom cannot be read at render time: then the config value stands.
*/}}
{{- define "kiw.envValue" -}}
{{- $name := .name }}
{{- range .ctx.Values.extraEnv }}
{{- if and (eq .name $name) (hasKey . "value") }}{{ .value }}{{ end }}
{{- end }}
{{- end }}

{{/* Settings read from the worker config (with the worker's own defaults), or from an extraEnv override. */}}
{{- define "kiw.metricsPort" -}}
{{- $env := include "kiw.envValue" (dict "ctx" . "name" "WORKER__METRICS__PORT") }}
{{- if $env }}{{ $env | int }}{{ else }}{{ dig "metrics" "port" 9400 (.Values.config | default dict) | int }}{{ end }}
{{- end }}

{{- define "kiw.groupId" -}}
{{- $env := include "kiw.envValue" (dict "ctx" . "name" "WORKER__KAFKA__GROUP_ID") }}
{{- if $env }}{{ $env }}{{ else }}{{ dig "kafka" "group_id" "kafka-inference-worker" (.Values.config | default dict) }}{{ end }}
{{- end }}

{{- define "kiw.bootstrapServers" -}}
{{- $env := include "kiw.envValue" (dict "ctx" . "name" "WORKER__KAFKA__BOOTSTRAP_SERVERS") }}
{{- if $env }}{{ $env }}{{ else }}{{ dig "kafka" "bootstrap_servers" "127.0.0.1:9092" (.Values.config | default dict) }}{{ end }}
{{- end }}

{{/* Every input topic of the config: kafka.input_topics plus batching.lanes[].topics, as a JSON list. */}}
{{- define "kiw.inputTopics" -}}
{{- $cfg := .Values.config | default dict }}
{{- $topics := list }}
{{- range (dig "kafka" "input_topics" (list) $cfg) }}{{ $topics = append $topics . }}{{ end }}
{{- range (dig "batching" "lanes" (list) $cfg) }}
{{- range (.topics | default list) }}{{ $topics = append $topics . }}{{ end }}
{{- end }}
{{- $topics | uniq | toJson }}
{{- end }}

{{/*
terminationGracePeriodSeconds: preStop sleep + the worker's shutdown budget + a margin for the process
to exit. Kubernetes counts the preStop hook inside the grace period, so both must fit.
*/}}
{{- define "kiw.shutdownBudget" -}}
{{- $shutdown := dig "delivery" "shutdown_timeout_s" 30 (.Values.config | default dict) | float64 | ceil | int }}
{{- $env := include "kiw.envValue" (dict "ctx" . "name" "WORKER__DELIVERY__SHUTDOWN_TIMEOUT_S") }}
{{- if $env }}{{ $shutdown = $env | float64 | ceil | int }}{{ end }}
{{- $preStop := .Values.lifecycle.preStopSleepSeconds | default 0 | int }}
{{- add $shutdown $preStop }}
{{- end }}

{{- define "kiw.terminationGracePeriodSeconds" -}}
{{- $budget := include "kiw.shutdownBudget" . | int }}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds }}
{{- add $budget (.Values.terminationGraceMarginSeconds | int) }}
{{- else }}
{{- .Values.terminationGracePeriodSeconds | int }}
{{- end }}
{{- end }}

{{/*
The worker config as rendered into the ConfigMap: .Values.config plus ${env:...} references for the
secrets the chart injects as env vars.
*/}}
{{- define "kiw.config" -}}
{{- $cfg := deepCopy (.Values.config | default dict) }}
{{- if .Values.secrets.kafkaSasl.enabled }}
{{- if not (get $cfg "kafka") }}{{ $_ := set $cfg "kafka" dict }}{{ end }}
{{- $kafka := get $cfg "kafka" }}
{{- range $side := list "consumer" "producer" }}
{{- if not (get $kafka $side) }}{{ $_ := set $kafka $side dict }}{{ end }}
{{- $props := get $kafka $side }}
{{- $_ := set $props "sasl.username" "${env:KIW_SASL_USERNAME}" }}
{{- $_ := set $props "sasl.password" "${env:KIW_SASL_PASSWORD}" }}
{{- end }}
{{- end }}
{{- if .Values.secrets.redisPassword.enabled }}
{{- if not (get $cfg "redis") }}{{ $_ := set $cfg "redis" dict }}{{ end }}
{{- $_ := set (get $cfg "redis") "password" "${env:KIW_REDIS_PASSWORD}" }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{/* Cross-field checks that values.schema.json cannot express. Included by the Deployment. */}}
{{- define "kiw.validate" -}}
{{- $cfg := .Values.config | default dict }}
{{- $budget := include "kiw.shutdownBudget" . | int }}
{{- if not (kindIs "invalid" .Values.terminationGracePeriodSeconds) }}
{{- if le (.Values.terminationGracePeriodSeconds | int) $budget }}
{{- fail (printf "terminationGracePeriodSeconds=%d must be larger than config.delivery.shutdown_timeout_s (or its extraEnv override) + lifecycle.preStopSleepSeconds = %d: Kubernetes would kill the worker before in-flight batches finish and offsets commit (leave it empty to derive it)" (.Values.terminationGracePeriodSeconds | int) $budget) }}
{{- end }}
{{- end }}
{{- if and (not (dig "metrics" "enabled" true $cfg)) (or .Values.probes.liveness.enabled .Values.probes.readiness.enabled .Values.probes.startup.enabled) }}
{{- fail "config.metrics.enabled=false leaves nothing to answer /healthz and /readyz: enable metrics or disable probes.*" }}
{{- end }}
{{- if and .Values.secrets.kafkaSasl.enabled (not .Values.secrets.kafkaSasl.secretName) }}
{{- fail "secrets.kafkaSasl.enabled needs secrets.kafkaSasl.secretName (an existing Secret)" }}
{{- end }}
{{- if and .Values.secrets.redisPassword.enabled (not .Values.secrets.redisPassword.secretName) }}
{{- fail "secrets.redisPassword.enabled needs secrets.redisPassword.secretName (an existing Secret)" }}
{{- end }}
{{- if eq (len (include "kiw.inputTopics" . | fromJsonArray)) 0 }}
{{- fail "config has no input topics: set config.kafka.input_topics or config.batching.lanes[].topics" }}
{{- end }}
{{- with .Values.autoscaling }}
{{- if .enabled }}
{{- if gt (.maxReplicas | int) (.partitions | int) }}
{{- fail (printf "autoscaling.maxReplicas=%d exceeds autoscaling.partitions=%d: a consumer group cannot use more consumers than partitions (the extra replicas would sit idle)" (.maxReplicas | int) (.partitions | int)) }}
{{- end }}
{{- if gt (.minReplicas | int) (.maxReplicas | int) }}
{{- fail (printf "autoscaling.minReplicas=%d exceeds autoscaling.maxReplicas=%d" (.minReplicas | int) (.maxReplicas | int)) }}
{{- end }}
{{- if and (eq .kind "hpa") (lt (.minReplicas | int) 1) }}
{{- fail "autoscaling.kind=hpa needs minReplicas >= 1 (scale to zero needs kind=keda)" }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
