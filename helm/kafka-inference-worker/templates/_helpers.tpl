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

{{/*
A librdkafka property of config.kafka.consumer (.prop, e.g. "security.protocol") as a string, "" when unset, with
what the secrets block sets there (kiw.config).
A literal extraEnv override wins, as in the worker: WORKER__KAFKA__CONSUMER__SECURITY_PROTOCOL (dots
become underscores in the variable's name).
*/}}
{{- define "kiw.consumerProp" -}}
{{- $env := include "kiw.envValue" (dict "ctx" .ctx "name" (printf "WORKER__KAFKA__CONSUMER__%s" (.prop | upper | replace "." "_"))) }}
{{- if $env }}{{ $env }}{{ else }}{{ dig "kafka" "consumer" .prop "" (include "kiw.config" .ctx | fromYaml) | toString }}{{ end }}
{{- end }}

{{/* metrics.enabled / metrics.host as the worker will read them (config, or a literal extraEnv override). */}}
{{- define "kiw.metricsEnabled" -}}
{{- $env := include "kiw.envValue" (dict "ctx" . "name" "WORKER__METRICS__ENABLED") }}
{{- if $env }}{{ not (has (lower $env) (list "false" "no" "off" "0")) }}{{ else }}{{ dig "metrics" "enabled" true (.Values.config | default dict) }}{{ end }}
{{- end }}

{{- define "kiw.metricsHost" -}}
{{- $cfg := .Values.config | default dict }}
{{- $env := include "kiw.envValue" (dict "ctx" . "name" "WORKER__METRICS__HOST") }}
{{- $hasEnv := false }}
{{- range .Values.extraEnv }}{{ if and (eq .name "WORKER__METRICS__HOST") (hasKey . "value") }}{{ $hasEnv = true }}{{ end }}{{ end }}
{{- if $hasEnv }}{{ $env }}{{ else }}{{ dig "metrics" "host" "0.0.0.0" $cfg | toString }}{{ end }}
{{- end }}

{{/*
The KEDA kafka trigger's settings, derived from the worker's consumer config the same way as the
bootstrap servers and the group, unless autoscaling.keda sets them: KEDA must reach the brokers and judge
uncommitted partitions exactly like the worker does.
*/}}
{{- define "kiw.kedaSasl" -}}
{{- if .Values.autoscaling.keda.sasl }}{{ .Values.autoscaling.keda.sasl }}
{{- else }}
{{- $mech := include "kiw.consumerProp" (dict "ctx" . "prop" "sasl.mechanism") | default (include "kiw.consumerProp" (dict "ctx" . "prop" "sasl.mechanisms")) | upper }}
{{- /* librdkafka's names -> KEDA's; with no mechanism configured, PLAIN (username/password). */}}
{{- $map := dict "" "plaintext" "PLAIN" "plaintext" "SCRAM-SHA-256" "scram_sha256" "SCRAM-SHA-512" "scram_sha512" "GSSAPI" "gssapi" "OAUTHBEARER" "oauthbearer" }}
{{- if not (hasKey $map $mech) }}
{{- fail (printf "config.kafka.consumer.sasl.mechanism=%s has no KEDA equivalent: set autoscaling.keda.sasl" $mech) }}
{{- end }}
{{- get $map $mech }}
{{- end }}
{{- end }}

{{- define "kiw.kedaTls" -}}
{{- if .Values.autoscaling.keda.tls }}{{ .Values.autoscaling.keda.tls }}
{{- else if has (include "kiw.consumerProp" (dict "ctx" . "prop" "security.protocol") | upper) (list "SSL" "SASL_SSL") }}enable
{{- end }}
{{- end }}

{{- define "kiw.kedaOffsetResetPolicy" -}}
{{- if .Values.autoscaling.keda.offsetResetPolicy }}{{ .Values.autoscaling.keda.offsetResetPolicy }}
{{- else }}
{{- /* The worker's default is earliest (worker/kafka/clients.py), not librdkafka's latest. */}}
{{- $reset := include "kiw.consumerProp" (dict "ctx" . "prop" "auto.offset.reset") | default "earliest" | lower }}
{{- if has $reset (list "earliest" "smallest" "beginning") }}earliest
{{- else if has $reset (list "latest" "largest" "end") }}latest
{{- else }}
{{- fail (printf "config.kafka.consumer.auto.offset.reset=%s has no KEDA equivalent (earliest or latest): set autoscaling.keda.offsetResetPolicy" $reset) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The input topics the worker will read, as JSON {"topics": [...], "unreadable": [...]}: kafka.input_topics plus
batching.lanes[].topics, after the literal extraEnv overrides the worker applies over the file, as for the group
and the brokers: WORKER__KAFKA__INPUT_TOPICS="[a, b]" (YAML), an item WORKER__KAFKA__INPUT_TOPICS__0=a, and the
same for a lane, WORKER__BATCHING__LANES__<n>__TOPICS(__<i>). "unreadable" names the overrides that may change
the topics but cannot be read at render time (valueFrom) or followed (a whole section: WORKER__KAFKA,
WORKER__BATCHING, WORKER__BATCHING__LANES(__<n>)); kiw.validate refuses them where KEDA needs the topics. A literal
the worker would refuse (not a list of names, an index past the list) fails rendering here.
*/}}
{{- define "kiw.inputTopicsInfo" -}}
{{- $cfg := .Values.config | default dict }}
{{- $input := list }}
{{- range (dig "kafka" "input_topics" (list) $cfg | default list) }}{{ $input = append $input (toString .) }}{{ end }}
{{- /* Without batching.lanes the worker has its one default lane, with no topics of its own. */}}
{{- $laneCfgs := list (dict) }}
{{- if hasKey (dig "batching" (dict) $cfg | default dict) "lanes" }}{{ $laneCfgs = dig "batching" "lanes" (list) $cfg | default list }}{{ end }}
{{- $lanes := dict }}
{{- range $i, $lane := $laneCfgs }}
{{- $t := list }}
{{- if kindIs "map" $lane }}{{ range ($lane.topics | default list) }}{{ $t = append $t (toString .) }}{{ end }}{{ end }}
{{- $_ := set $lanes (toString $i) $t }}
{{- end }}
{{- $unreadable := list }}
{{- $items := list }}
{{- range $e := .Values.extraEnv | default list }}
{{- if hasPrefix "WORKER__" ($e.name | toString) }}
{{- /* The worker's reading of the name: case-insensitive after the prefix, empty parts skipped. */}}
{{- $n := printf "WORKER__%s" (splitList "__" (upper (trimPrefix "WORKER__" $e.name)) | compact | join "__") }}
{{- $whole := regexMatch "^WORKER__(KAFKA|BATCHING|BATCHING__LANES|BATCHING__LANES__[0-9]+)$" $n }}
{{- $topicsVar := regexMatch "^WORKER__(KAFKA__INPUT_TOPICS|BATCHING__LANES__[0-9]+__TOPICS)(__[0-9]+)?$" $n }}
{{- if or $whole (and $topicsVar (hasKey $e "valueFrom")) }}
{{- $unreadable = append $unreadable $e.name }}
{{- else if and $topicsVar (regexMatch "TOPICS__[0-9]+$" $n) }}
{{- $items = append $items (dict "n" $n "name" $e.name "value" ($e.value | default "" | toString)) }}
{{- else if $topicsVar }}
{{- $raw := $e.value | default "" | toString }}
{{- $parsed := printf "v:\n%s" (indent 2 $raw) | fromYaml }}
{{- $ok := and (not (hasKey $parsed "Error")) (kindIs "slice" (get $parsed "v")) }}
{{- if $ok }}{{ range (get $parsed "v") }}{{ if not (and (kindIs "string" .) .) }}{{ $ok = false }}{{ end }}{{ end }}{{ end }}
{{- if not $ok }}
{{- fail (printf "extraEnv %s=%q is not a YAML list of topic names (e.g. \"[orders-v2]\"): the worker would refuse it" $e.name $raw) }}
{{- end }}
{{- if eq $n "WORKER__KAFKA__INPUT_TOPICS" }}
{{- $input = get $parsed "v" }}
{{- else }}
{{- $li := regexReplaceAll "^WORKER__BATCHING__LANES__([0-9]+)__TOPICS$" $n "${1}" | atoi }}
{{- if ge $li (len $laneCfgs) }}
{{- fail (printf "extraEnv %s: the config has no batching.lanes[%d] (%d lane(s)): the worker would refuse it" $e.name $li (len $laneCfgs)) }}
{{- end }}
{{- $_ := set $lanes (toString $li) (get $parsed "v") }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- /* Items after whole lists, as the worker applies them (in the variables' sorted order). */}}
{{- range $items }}
{{- $idx := regexReplaceAll "^.*TOPICS__([0-9]+)$" .n "${1}" | atoi }}
{{- $lane := "" }}
{{- $cur := $input }}
{{- if hasPrefix "WORKER__BATCHING__" .n }}
{{- $li := regexReplaceAll "^WORKER__BATCHING__LANES__([0-9]+)__TOPICS__[0-9]+$" .n "${1}" | atoi }}
{{- if ge $li (len $laneCfgs) }}
{{- fail (printf "extraEnv %s: the config has no batching.lanes[%d] (%d lane(s)): the worker would refuse it" .name $li (len $laneCfgs)) }}
{{- end }}
{{- $lane = toString $li }}
{{- $cur = get $lanes $lane }}
{{- end }}
{{- if ge $idx (len $cur) }}
{{- fail (printf "extraEnv %s: that topic list has no item %d (%d topic(s)): the worker would refuse it" .name $idx (len $cur)) }}
{{- end }}
{{- if not .value }}
{{- fail (printf "extraEnv %s is empty: the worker would refuse an empty topic name" .name) }}
{{- end }}
{{- $v := .value }}
{{- $new := list }}
{{- range $j, $x := $cur }}{{ $new = append $new (ternary $v $x (eq $j $idx)) }}{{ end }}
{{- if $lane }}{{ $_ := set $lanes $lane $new }}{{ else }}{{ $input = $new }}{{ end }}
{{- end }}
{{- $topics := $input }}
{{- range $i := until (len $laneCfgs) }}{{ $topics = concat $topics (get $lanes (toString $i)) }}{{ end }}
{{- dict "topics" ($topics | uniq) "unreadable" $unreadable | toJson }}
{{- end }}

{{/* Every input topic the worker will read (see kiw.inputTopicsInfo), as a JSON list. */}}
{{- define "kiw.inputTopics" -}}
{{- get (include "kiw.inputTopicsInfo" . | fromJson) "topics" | toJson }}
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

{{/*
What a stop takes past delivery.shutdown_timeout_s at most (README, "Delivery guarantees": the revoke on leaving
the group waits no longer than the same deadline, the devices stop together within 5 s and the producers' last
flush shares another 5 s: about 13 s when the broker is unreachable or a device hangs). The grace period must
cover it too, or the kubelet SIGKILLs a worker that is still committing.
*/}}
{{- define "kiw.stopOverheadSeconds" -}}13{{- end }}

{{- define "kiw.terminationGracePeriodSeconds" -}}
{{- $budget := include "kiw.shutdownBudget" . | int }}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds }}
{{- add $budget (.Values.terminationGraceMarginSeconds | int) }}
{{- else }}
{{- .Values.terminationGracePeriodSeconds | int }}
{{- end }}
{{- end }}

{{/* "true" when an int-or-percent value (maxSurge, maxUnavailable) is zero; unset is not (Kubernetes: 25%). */}}
{{- define "kiw.isZero" -}}
{{- if has (toString .) (list "0" "0%") }}true{{ end }}
{{- end }}

{{/*
A fixed transactional.id, as the worker will use it in exactly-once mode: "" when there is none (the worker's
default, <group_id>-<hostname>, is one per pod) or when the id differs per pod or cannot be judged at render
time; else a description of it. The id is config.delivery.transactional_id or WORKER__DELIVERY__TRANSACTIONAL_ID
in extraEnv (a literal value, or valueFrom: one Secret or ConfigMap value for every pod, unless a fieldRef to the
pod's name, uid or IP). An id is per pod when it refers to ${env:POD_NAME}, ${env:HOSTNAME} or an extraEnv
variable from such a fieldRef; a ${file:...} or a variable the chart does not know (extraEnvFrom) cannot be judged.
*/}}
{{- define "kiw.fixedTransactionalId" -}}
{{- $cfg := .Values.config | default dict }}
{{- $mode := dig "delivery" "mode" "at_least_once" $cfg | toString }}
{{- $envMode := include "kiw.envValue" (dict "ctx" . "name" "WORKER__DELIVERY__MODE") }}
{{- if $envMode }}{{ $mode = $envMode }}{{ end }}
{{- if eq $mode "exactly_once" }}
{{- $perPodFields := list "metadata.name" "metadata.uid" "status.podIP" }}
{{- /* Env vars of the pod: name -> "pod" (differs per pod) or "fixed" (one value for every pod). */}}
{{- $vars := dict "POD_NAME" "pod" "HOSTNAME" "pod" "POD_NAMESPACE" "fixed" "KIW_HEALTHCHECK_URL" "fixed" "KIW_SASL_USERNAME" "fixed" "KIW_SASL_PASSWORD" "fixed" "KIW_REDIS_PASSWORD" "fixed" "KIW_REDIS_USERNAME" "fixed" "KIW_KAFKA_KEY_PASSWORD" "fixed" }}
{{- $id := dig "delivery" "transactional_id" "" $cfg | default "" | toString }}
{{- $from := printf "config.delivery.transactional_id=%q" $id }}
{{- $perPod := false }}
{{- range $e := .Values.extraEnv | default list }}
{{- $fieldPath := "" }}
{{- if hasKey $e "valueFrom" }}{{ $fieldPath = dig "fieldRef" "fieldPath" "" ($e.valueFrom | default dict) }}{{ end }}
{{- $_ := set $vars $e.name (ternary "pod" "fixed" (has $fieldPath $perPodFields)) }}
{{- if eq $e.name "WORKER__DELIVERY__TRANSACTIONAL_ID" }}
{{- if hasKey $e "valueFrom" }}
{{- $id = "(valueFrom)" }}
{{- $from = "WORKER__DELIVERY__TRANSACTIONAL_ID in extraEnv (valueFrom: one value for every pod)" }}
{{- $perPod = has $fieldPath $perPodFields }}
{{- else }}
{{- $id = $e.value | default "" | toString }}
{{- $from = printf "WORKER__DELIVERY__TRANSACTIONAL_ID=%q in extraEnv" $id }}
{{- $perPod = false }}
{{- end }}
{{- end }}
{{- end }}
{{- $refs := regexFindAll "\\$\\{(env|file):[^}]+\\}" $id -1 }}
{{- range $refs }}
{{- if hasPrefix "${file:" . }}{{ $perPod = true }}
{{- else }}
{{- $var := trimSuffix "}" (trimPrefix "${env:" .) | trim }}
{{- if ne (get $vars $var) "fixed" }}{{ $perPod = true }}{{ end }}
{{- end }}
{{- end }}
{{- if and $id (not $perPod) }}{{ $from }}{{ end }}
{{- end }}
{{- end }}

{{/* Cross-field checks that values.schema.json cannot express. Included by the Deployment. */}}
{{- define "kiw.validate" -}}
{{- $cfg := .Values.config | default dict }}
{{- $strategy := .Values.updateStrategy | default dict }}
{{- if eq ($strategy.type | default "RollingUpdate") "RollingUpdate" }}
{{- $ru := $strategy.rollingUpdate | default dict }}
{{- if and (include "kiw.isZero" (get $ru "maxSurge")) (include "kiw.isZero" (get $ru "maxUnavailable")) }}
{{- fail "updateStrategy.rollingUpdate: maxSurge and maxUnavailable are both 0, so a rollout could never replace a pod (the API server refuses the Deployment): set one of them above 0, or use type: Recreate" }}
{{- end }}
{{- end }}
{{- /* Exactly-once with one fixed transactional.id: only one pod may ever run it, even during a rollout. */}}
{{- $fixedId := include "kiw.fixedTransactionalId" . }}
{{- if $fixedId }}
{{- $pods := list }}
{{- if .Values.autoscaling.enabled }}
{{- if gt (.Values.autoscaling.maxReplicas | int) 1 }}{{ $pods = append $pods (printf "autoscaling.enabled with maxReplicas=%d" (.Values.autoscaling.maxReplicas | int)) }}{{ end }}
{{- else if gt (.Values.replicaCount | int) 1 }}
{{- $pods = append $pods (printf "replicaCount=%d" (.Values.replicaCount | int)) }}
{{- end }}
{{- if eq ($strategy.type | default "RollingUpdate") "RollingUpdate" }}
{{- $surge := get ($strategy.rollingUpdate | default dict) "maxSurge" }}
{{- if not (include "kiw.isZero" $surge) }}
{{- $surgeText := ternary "25% (Kubernetes' default)" (toString $surge) (or (kindIs "invalid" $surge) (eq (toString $surge) "")) }}
{{- $pods = append $pods (printf "updateStrategy.rollingUpdate.maxSurge=%s starts a new pod beside the old one" $surgeText) }}
{{- end }}
{{- end }}
{{- if $pods }}
{{- fail (printf "%s is one transactional.id for every pod (delivery.mode exactly_once), but %s: two pods with one transactional.id fence each other (each one's start aborts the other's open transaction). Leave it unset (the worker then uses <group_id>-<hostname>, one per pod), or run exactly one pod: replicaCount: 1, no autoscaling, and updateStrategy.rollingUpdate.maxSurge: 0 (or updateStrategy.type: Recreate)" $fixedId (join "; " $pods)) }}
{{- end }}
{{- end }}
{{- $budget := include "kiw.shutdownBudget" . | int }}
{{- $overhead := include "kiw.stopOverheadSeconds" . | int }}
{{- $grace := include "kiw.terminationGracePeriodSeconds" . | int }}
{{- if lt $grace (add $budget $overhead) }}
{{- $why := printf "the worker's stop takes up to shutdown_timeout_s + about %d s when the broker is unreachable or a device hangs (devices stop within 5 s, the producers' last flush shares another 5 s, plus the revoke), and Kubernetes would SIGKILL it before in-flight batches finish and offsets commit" $overhead }}
{{- if not (kindIs "invalid" .Values.terminationGracePeriodSeconds) }}
{{- fail (printf "terminationGracePeriodSeconds=%d must be at least config.delivery.shutdown_timeout_s (or its extraEnv override) + lifecycle.preStopSleepSeconds + %d s = %d: %s (leave it empty to derive it)" $grace $overhead (add $budget $overhead) $why) }}
{{- else }}
{{- fail (printf "terminationGraceMarginSeconds=%d must be at least %d: %s" (.Values.terminationGraceMarginSeconds | int) $overhead $why) }}
{{- end }}
{{- end }}
{{- if or .Values.probes.liveness.enabled .Values.probes.readiness.enabled .Values.probes.startup.enabled }}
{{- if not (include "kiw.metricsEnabled" . | eq "true") }}
{{- fail "config.metrics.enabled=false (or an extraEnv WORKER__METRICS__ENABLED) leaves nothing to answer /healthz and /readyz: enable metrics or disable probes.*" }}
{{- end }}
{{- /* httpGet: the kubelet probes the pod IP, which a loopback (or any single-address) bind never answers. exec
probes call 127.0.0.1 (::1) from inside the container: they need a bind that answers there. */}}
{{- $host := include "kiw.metricsHost" . }}
{{- if and (eq .Values.probes.mode "httpGet") (not (has $host (list "0.0.0.0" "::" ""))) }}
{{- fail (printf "config.metrics.host=%s (or an extraEnv WORKER__METRICS__HOST): the kubelet probes the pod IP, so the probes would never pass; use 0.0.0.0 (or ::), probes.mode: exec (which probes from inside the pod), or disable probes.*" $host) }}
{{- end }}
{{- if and (eq .Values.probes.mode "exec") (not (has $host (list "0.0.0.0" "::" "" "127.0.0.1" "::1" "localhost"))) }}
{{- fail (printf "config.metrics.host=%s (or an extraEnv WORKER__METRICS__HOST): probes.mode exec calls the loopback address, which this bind does not answer; use 127.0.0.1, ::1, 0.0.0.0 or ::" $host) }}
{{- end }}
{{- end }}
{{- include "kiw.validateSecrets" . }}
{{- $topicsInfo := include "kiw.inputTopicsInfo" . | fromJson }}
{{- if and (eq (len $topicsInfo.topics) 0) (not $topicsInfo.unreadable) }}
{{- fail "config has no input topics (after extraEnv overrides): set config.kafka.input_topics or config.batching.lanes[].topics" }}
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
{{- $a := .Values.autoscaling }}
{{- if and $a.enabled (eq $a.kind "keda") }}
{{- /* One trigger per topic the worker reads: an override the chart cannot read would leave KEDA measuring
the lag of other topics (and, at zero replicas, never waking for the real ones). */}}
{{- if and (not $a.keda.topics) $topicsInfo.unreadable }}
{{- fail (printf "extraEnv %s may set the input topics, but the chart cannot read it at render time (valueFrom, or a whole section): KEDA would scale on the lag of the config's topics, not those the worker reads. Give the topics as a literal value (WORKER__KAFKA__INPUT_TOPICS: \"[a, b]\", WORKER__BATCHING__LANES__<n>__TOPICS) or list them in autoscaling.keda.topics" (join ", " $topicsInfo.unreadable)) }}
{{- end }}
{{- /* KEDA connects to the brokers itself: what the worker needs to reach them, KEDA needs too. */}}
{{- $refs := dict }}
{{- range $r := include "kiw.kedaSecretRefs" . | fromJsonArray }}
{{- if hasKey $refs $r.parameter }}
{{- fail (printf "%s: parameter %s is given twice (also by %s)" $r.from $r.parameter (get $refs $r.parameter).from) }}
{{- end }}
{{- $_ := set $refs $r.parameter $r }}
{{- end }}
{{- if ne (hasKey $refs "cert") (hasKey $refs "key") }}
{{- fail "autoscaling.keda.extraSecretTargetRefs: KEDA takes a client certificate only as cert and key together" }}
{{- end }}
{{- if and (hasKey $refs "keyPassword") (not (hasKey $refs "key")) }}
{{- fail "autoscaling.keda.extraSecretTargetRefs: keyPassword without key (it decrypts the client key)" }}
{{- end }}
{{- if eq (include "kiw.kedaTls" .) "enable" }}
{{- range $prop := list "ssl.ca.location" "ssl.ca.pem" }}
{{- $v := include "kiw.consumerProp" (dict "ctx" $ "prop" $prop) }}
{{- /* "probe" is librdkafka's system trust store, which KEDA uses too when given no CA; so is a system bundle
(/etc/ssl/..., /etc/pki/...), e.g. a public CA's brokers (Confluent Cloud) named explicitly. systemCA: true
says the CA is one KEDA's own trust store has. */}}
{{- $system := or (eq $v "probe") (hasPrefix "/etc/ssl/" $v) (hasPrefix "/etc/pki/" $v) $a.keda.systemCA }}
{{- if and $v (not $system) (not (hasKey $refs "ca")) }}
{{- fail (printf "config.kafka.consumer.%s is set (the brokers' certificates are signed by a private CA) but KEDA is not given that CA: it could not read the group's lag (with minReplicas 0 no pod would ever start). Add {parameter: ca, name: <Secret>, key: <PEM key>} to autoscaling.keda.extraSecretTargetRefs" $prop) }}
{{- end }}
{{- end }}
{{- range $prop := list "ssl.certificate.location" "ssl.certificate.pem" }}
{{- if and (include "kiw.consumerProp" (dict "ctx" $ "prop" $prop)) (not (hasKey $refs "cert")) }}
{{- fail (printf "config.kafka.consumer.%s is set (the brokers require a client certificate) but KEDA is not given one: add cert and key entries to autoscaling.keda.extraSecretTargetRefs" $prop) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
An exec probe's command (probes.mode exec): python3 in the worker container calls .path on the loopback address,
so the worker may bind to 127.0.0.1 and keep /metrics, /healthz and /readyz inside the pod. urllib raises on a
status other than 2xx, which exits 1.
*/}}
{{- define "kiw.execProbe" -}}
{{- $host := include "kiw.metricsHost" .ctx }}
{{- $addr := ternary "[::1]" "127.0.0.1" (has $host (list "::" "::1")) }}
{{- $port := include "kiw.metricsPort" .ctx | int }}
{{- $n := include "kiw.processes" .ctx | int }}
{{- if le $n 1 }}
{{- $url := printf "http://%s:%d%s" $addr $port .path }}
{{- list "python3" "-c" (printf "import urllib.request; urllib.request.urlopen(%s, timeout=%d)" ($url | squote) (.timeout | int)) | toJson }}
{{- else }}
{{- /* Every process: the pod is healthy (ready) only when each of them is. */}}
{{- $url := printf "http://%s:%%d%s" $addr .path }}
{{- list "python3" "-c" (printf "import urllib.request; [urllib.request.urlopen(%s %% p, timeout=%d) for p in range(%d, %d)]" ($url | squote) (.timeout | int) $port (add $port $n)) | toJson }}
{{- end }}
{{- end }}

{{/* Worker processes per pod (values.processes); process i serves metrics on metrics.port + i. */}}
{{- define "kiw.processes" -}}
{{- .Values.processes | default 1 | int }}
{{- end }}

{{/* The container ports' names, one per process: metrics, metrics-1, ... (JSON list). */}}
{{- define "kiw.metricsPortNames" -}}
{{- $names := list "metrics" }}
{{- range $i := untilStep 1 (include "kiw.processes" . | int) 1 }}{{ $names = append $names (printf "metrics-%d" $i) }}{{ end }}
{{- $names | toJson }}
{{- end }}
