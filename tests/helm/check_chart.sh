#!/usr/bin/env bash
# Chart checks for helm/kafka-inference-worker, all offline:
#   1. helm lint --strict (default values, everything on, the HPA variant)
#   2. helm template for a matrix of values; each rendering is validated against the Kubernetes JSON
#      schemas bundled by the kubernetes-validate package (strict, two Kubernetes versions), custom
#      resources (KEDA, ServiceMonitor) structurally, plus chart invariants (validate_manifests.py)
#   3. the worker config inside each rendered ConfigMap passes `worker check-config` (exit 0)
#   4. negative cases: bad values fail at render time with the right message, and a config value the
#      worker rejects makes `worker check-config` exit 2
#   5. secrets and TLS (cases_security.sh), alerts, dashboard, NetworkPolicy, helm test, probes and pod extras
#      (cases_observability.sh): rendered, validated, asserted, and their negative cases
#
# Usage: tests/helm/check_chart.sh [--print-helm]   (PY: a python with the package's deps and kubernetes-validate;
#        default: python3). Helm is built once from the Go module proxy into
#        ~/.cache/kafka-inference-worker/tools/helm-$HELM_VERSION and reused; HELM=/path/helm skips that.
#        --print-helm: only build (or find) helm and print its path.
# Exit 0 when everything passes; non-zero otherwise. A missing tool (go, python module) is a failure.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
chart="$root/helm/kafka-inference-worker"
PY=${PY:-python3}
HELM_VERSION=${HELM_VERSION:-v3.19.0}
# The Kubernetes version helm renders for, and the versions the manifests are validated against: the
# chart's kubeVersion floor and the newest schema set kubernetes-validate bundles.
KUBE_VERSION=${KUBE_VERSION:-1.30.0}
VALIDATE_VERSIONS=${VALIDATE_VERSIONS:-1.25.0 1.37.0}
tools=${KIW_TOOLS_DIR:-${KIW_CACHE:-$HOME/.cache/kafka-inference-worker}/tools}  # the cache setup_env.sh uses

failures=0
checks=0
pass() { checks=$((checks + 1)); printf '  ok    %s\n' "$1"; }
fail() { checks=$((checks + 1)); failures=$((failures + 1)); printf '  FAIL  %s\n' "$1"; [ -n "${2:-}" ] && printf '%s\n' "$2" | sed 's/^/        /'; return 0; }
die() { printf 'check_chart: %s\n' "$1" >&2; exit 2; }

# ------------------------------------------------------------------------------------------ tools
ensure_helm() {
  if [ -n "${HELM:-}" ]; then
    [ -x "$HELM" ] || die "HELM=$HELM is not executable"
    return
  fi
  HELM="$tools/helm-$HELM_VERSION/helm"
  [ -x "$HELM" ] && return
  command -v go >/dev/null || die "go is needed to build helm $HELM_VERSION (or set HELM=/path/to/helm)"
  mkdir -p "$tools"
  # One build at a time (pytest and a manual run may race); build aside, then move into place.
  exec 9>"$tools/.helm-$HELM_VERSION.lock"
  command -v flock >/dev/null && flock 9
  if [ ! -x "$HELM" ]; then
    echo "building helm $HELM_VERSION from the Go module proxy (once; cached in $tools)"
    local tmp k8s_minor=34
    tmp=$(mktemp -d "$tools/.helm-build.XXXXXX")
    # The ldflags mirror helm's Makefile: a real version string and Kubernetes 1.$k8s_minor as the
    # default capabilities (helm v3.19 is built against client-go v0.34).
    GOBIN="$tmp" GOFLAGS="${GOFLAGS:-} -trimpath" go install -ldflags "-s -w \
      -X helm.sh/helm/v3/internal/version.version=$HELM_VERSION \
      -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/lint/rules.k8sVersionMinor=$k8s_minor \
      -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMajor=1 -X helm.sh/helm/v3/pkg/chartutil.k8sVersionMinor=$k8s_minor" \
      "helm.sh/helm/v3/cmd/helm@$HELM_VERSION" || { rm -rf "$tmp"; die "building helm failed"; }
    mkdir -p "$(dirname "$HELM")"
    mv "$tmp/helm" "$HELM"
    rm -rf "$tmp"
  fi
  exec 9>&-
}

ensure_helm
if [ "${1:-}" = "--print-helm" ]; then  # for the pytest checks: build helm if needed, print its path
  echo "$HELM"; exit 0
fi
"$PY" -c "import kubernetes_validate, jsonschema, yaml" 2>/dev/null \
  || die "$PY lacks kubernetes-validate (offline Kubernetes schemas): pip install kubernetes-validate"

# `worker check-config` is the contract; before the CLI had it, config.load was the same check.
if grep -q '"check-config"' "$root/worker/app/cli.py" 2>/dev/null; then
  check_config() { PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m worker check-config --config "$1"; }
else
  check_config() {
    PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c '
import sys, worker.config.settings as c
try:
    c.load(sys.argv[1])
except c.ConfigError as e:
    print(f"config error: {e}", file=sys.stderr); sys.exit(2)
print(sys.argv[1] + ": OK")' "$1"
  }
fi
# The ${env:...} secret references the chart writes must resolve when the config is checked.
export KIW_SASL_USERNAME=check-user KIW_SASL_PASSWORD=check-password KIW_REDIS_PASSWORD=check-redis \
  KIW_REDIS_USERNAME=check-redis-user KIW_KAFKA_KEY_PASSWORD=check-key-password

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
validate_args=()
for v in $VALIDATE_VERSIONS; do validate_args+=(--kube-version "$v"); done

render() {  # render NAME [helm args...] -> $work/NAME.yaml
  local name=$1; shift
  "$HELM" template kiw "$chart" --namespace inference --kube-version "$KUBE_VERSION" "$@" \
    >"$work/$name.yaml" 2>"$work/$name.err"
}

echo "helm: $("$HELM" version --short 2>/dev/null || echo "$HELM")  chart: $chart"

# ------------------------------------------------------------------------------------------ 1. lint
echo "lint"
lint_case() {
  local name=$1; shift
  if out=$("$HELM" lint --strict --kube-version "$KUBE_VERSION" "$chart" "$@" 2>&1); then
    pass "helm lint --strict ($name)"
  else
    fail "helm lint --strict ($name)" "$out"
  fi
}
lint_case default
lint_case all-on -f "$here/values-all-on.yaml"
lint_case all-on+hpa -f "$here/values-all-on.yaml" -f "$here/values-hpa.yaml"

# ----------------------------------------------------------- 2+3. render, validate, check-config
echo "render + validate + check-config"
good_case() {
  local name=$1; shift
  if ! render "$name" "$@"; then
    fail "$name: helm template" "$(cat "$work/$name.err")"; return
  fi
  if out=$("$PY" "$here/validate_manifests.py" "${validate_args[@]}" \
             --extract-config "$work/$name.config.yaml" "$work/$name.yaml" 2>&1); then
    pass "$name: ${out#valid }"
  else
    fail "$name: manifests" "$out"; return
  fi
  if out=$(check_config "$work/$name.config.yaml" 2>&1); then
    pass "$name: worker check-config exit 0"
  else
    fail "$name: worker check-config exit $? on the rendered config" "$out"
  fi
}
good_case default
good_case all-on-keda -f "$here/values-all-on.yaml"
good_case all-on-hpa -f "$here/values-all-on.yaml" -f "$here/values-hpa.yaml"
good_case keda-plain --set autoscaling.enabled=true
good_case hpa-pods --set autoscaling.enabled=true --set autoscaling.kind=hpa
good_case gpu-only --set gpu.enabled=true --set config.model.device=cuda --set lifecycle.preStopSleepSeconds=0
# Recreate takes no rollingUpdate (the API server refuses one next to it; the validator checks), and the GPU-pool
# rollout (no surge) renders.
good_case recreate --set updateStrategy.type=Recreate
good_case no-surge --set updateStrategy.rollingUpdate.maxSurge=0 --set updateStrategy.rollingUpdate.maxUnavailable=1
# /tmp without a size limit (the schema allows null) is still an emptyDir, `emptyDir: {}` (a bare `emptyDir:` is
# null: no volume type); with medium Memory it keeps the medium.
good_case tmp-unlimited --set tmpVolume.sizeLimit=null
# A grace period of exactly shutdown 30 + preStop 5 + the worker's stop overhead 13 = 48 renders and validates.
good_case grace-at-overhead --set terminationGracePeriodSeconds=48
# Exactly-once with a fixed delivery.transactional_id: only as one pod that no rollout doubles (no surge, or
# Recreate). An id per pod (${env:POD_NAME}), or at-least-once (which ignores the id), renders with replicas.
good_case eos-fixed-id-one-pod --set config.delivery.mode=exactly_once --set config.delivery.transactional_id=kiw-tx \
  --set updateStrategy.rollingUpdate.maxSurge=0 --set updateStrategy.rollingUpdate.maxUnavailable=1
if render eos-fixed-id-recreate --set config.delivery.mode=exactly_once --set config.delivery.transactional_id=kiw-tx \
     --set updateStrategy.type=Recreate \
   && render eos-pod-id-replicas --set config.delivery.mode=exactly_once --set replicaCount=3 \
     --set 'config.delivery.transactional_id=kiw-${env:POD_NAME}' \
   && render alo-fixed-id-replicas --set config.delivery.transactional_id=kiw-tx --set replicaCount=3; then
  pass "fixed transactional id with Recreate, a per-pod id with 3 replicas, at-least-once with an id: render"
else
  fail "fixed transactional id with Recreate, a per-pod id with 3 replicas, at-least-once with an id: render" \
    "$(cat "$work"/eos-fixed-id-recreate.err "$work"/eos-pod-id-replicas.err "$work"/alo-fixed-id-replicas.err)"
fi
good_case tmp-memory-unlimited --set tmpVolume.sizeLimit=null --set tmpVolume.medium=Memory
if grep -qxF '          emptyDir: {}' "$work/tmp-unlimited.yaml" \
   && grep -A1 -xF '          emptyDir:' "$work/tmp-memory-unlimited.yaml" | grep -qxF '            medium: Memory'; then
  pass "tmpVolume without sizeLimit: emptyDir {} (or with its medium)"
else
  fail "tmpVolume without sizeLimit: emptyDir {} (or with its medium)" "$(grep -n -A2 'emptyDir' "$work"/tmp-*.yaml)"
fi

# processes: 3 runs `worker run --processes 3`; each process's port is a container port, a Service port, a
# ServiceMonitor endpoint and a NetworkPolicy port, and the probes (exec, httpGet reaches one port) check all.
good_case processes-3 --set processes=3 --set serviceMonitor.enabled=true --set networkPolicy.enabled=true \
  --set 'networkPolicy.metricsFrom[0].podSelector.matchLabels.app=prometheus'
f="$work/processes-3.yaml"
if grep -qF '"--processes", "3"]' "$f" && grep -qF 'containerPort: 9402' "$f" \
   && [ "$(grep -c 'targetPort: metrics-[12]$' "$f")" = 2 ] && [ "$(grep -c '^    - port: metrics' "$f")" = 3 ] \
   && [ "$(grep -c '^        - port: metrics' "$f")" = 3 ] \
   && [ "$(grep -cF 'for p in range(9400, 9403)]' "$f")" = 3 ] && ! grep -q 'httpGet:' "$f" \
   && ! grep -qF -- '--processes' "$work/default.yaml" && grep -q 'httpGet:' "$work/default.yaml"; then
  pass "processes: 3: args, 3 ports (container, Service, ServiceMonitor, NetworkPolicy), exec probes over all"
else
  fail "processes: 3: args, 3 ports (container, Service, ServiceMonitor, NetworkPolicy), exec probes over all" \
    "$(grep -n -e processes -e 'metrics' -e 'range(' "$f")"
fi

# The KEDA variant renders no HPA and the HPA variant no ScaledObject (they are exclusive).
if grep -q '^kind: HorizontalPodAutoscaler' "$work/all-on-keda.yaml" || ! grep -q '^kind: ScaledObject' "$work/all-on-keda.yaml" \
   || grep -q '^kind: ScaledObject' "$work/all-on-hpa.yaml" || ! grep -q '^kind: HorizontalPodAutoscaler' "$work/all-on-hpa.yaml"; then
  fail "KEDA and HPA variants are exclusive"
else
  pass "KEDA and HPA variants are exclusive"
fi
# A config change changes the pod template (checksum/config), so the pods roll.
render checksum-a && render checksum-b --set config.logging.level=DEBUG
if [ "$(grep checksum/config "$work/checksum-a.yaml")" != "$(grep checksum/config "$work/checksum-b.yaml")" ]; then
  pass "config change changes checksum/config"
else
  fail "config change changes checksum/config"
fi

# The grace period follows a shutdown timeout set through extraEnv (the worker reads WORKER__ env over the
# file): 120 + preStop 5 + margin 15 = 140.
render grace-from-env --set 'extraEnv[0].name=WORKER__DELIVERY__SHUTDOWN_TIMEOUT_S' --set-string 'extraEnv[0].value=120'
if grep -q 'terminationGracePeriodSeconds: 140$' "$work/grace-from-env.yaml"; then
  pass "terminationGracePeriodSeconds follows an extraEnv shutdown timeout"
else
  fail "terminationGracePeriodSeconds follows an extraEnv shutdown timeout" "$(grep -n terminationGrace "$work/grace-from-env.yaml")"
fi

# The metrics port (Service, probes) and the consumer group (KEDA's lag query) follow extraEnv overrides too.
render port-group-from-env --set autoscaling.enabled=true \
  --set 'extraEnv[0].name=WORKER__METRICS__PORT' --set-string 'extraEnv[0].value=9555' \
  --set 'extraEnv[1].name=WORKER__KAFKA__GROUP_ID' --set-string 'extraEnv[1].value=group-from-env'
if grep -q ' port: 9555$' "$work/port-group-from-env.yaml" && grep -q 'containerPort: 9555$' "$work/port-group-from-env.yaml" \
   && grep -q 'consumerGroup: "group-from-env"$' "$work/port-group-from-env.yaml"; then
  pass "metrics port and consumer group follow extraEnv overrides"
else
  fail "metrics port and consumer group follow extraEnv overrides" \
    "$(grep -nE 'port:|consumerGroup' "$work/port-group-from-env.yaml")"
fi

# KEDA's triggers follow the input topics the worker reads after literal extraEnv overrides: the whole list
# (YAML), one item, a lane's list (lane 0 is the default lane, which the default config gives no topics).
render topics-from-env --set autoscaling.enabled=true \
  --set 'extraEnv[0].name=WORKER__KAFKA__INPUT_TOPICS' --set-string 'extraEnv[0].value=[orders-v2]'
render topics-items-from-env --set autoscaling.enabled=true \
  --set 'extraEnv[0].name=WORKER__KAFKA__INPUT_TOPICS' --set-string 'extraEnv[0].value=[a\, b]' \
  --set 'extraEnv[1].name=WORKER__KAFKA__INPUT_TOPICS__1' --set-string 'extraEnv[1].value=orders-b' \
  --set 'extraEnv[2].name=WORKER__BATCHING__LANES__0__TOPICS' --set-string 'extraEnv[2].value=[lane-0]'
# An override the chart cannot read is fine when autoscaling.keda.topics names the topics.
render topics-valuefrom-keda-topics --set autoscaling.enabled=true --set 'autoscaling.keda.topics[0]=orders-v3' \
  --set 'extraEnv[0].name=WORKER__KAFKA__INPUT_TOPICS' --set 'extraEnv[0].valueFrom.configMapKeyRef.name=topics' \
  --set 'extraEnv[0].valueFrom.configMapKeyRef.key=input'
if [ "$(grep ' topic: ' "$work/topics-from-env.yaml")" = '        topic: "orders-v2"' ] \
   && [ "$(grep ' topic: ' "$work/topics-items-from-env.yaml" | tr -d ' \n')" = 'topic:"a"topic:"orders-b"topic:"lane-0"' ] \
   && [ "$(grep ' topic: ' "$work/topics-valuefrom-keda-topics.yaml")" = '        topic: "orders-v3"' ]; then
  pass "KEDA topics follow extraEnv topic overrides (list, item, lane), or autoscaling.keda.topics"
else
  fail "KEDA topics follow extraEnv topic overrides (list, item, lane), or autoscaling.keda.topics" \
    "$(grep -n ' topic: ' "$work"/topics-*.yaml; cat "$work"/topics-*.err)"
fi

# KEDA reaches the brokers like the worker: sasl, tls and offsetResetPolicy follow the consumer config, which
# values-all-on.yaml gets from secrets.kafkaSasl (SCRAM-SHA-512) and secrets.kafkaTls (CA, client certificate,
# encrypted key), and the TriggerAuthentication takes the same Secret keys. (validate_manifests.py checks that
# each TriggerAuthentication entry is the Secret key the pod reads.)
has_all() {  # has_all FILE FIXED-LINE... : every line occurs in FILE
  local f=$1; shift
  for line in "$@"; do grep -qxF -- "$line" "$f" || return 1; done
}
if has_all "$work/all-on-keda.yaml" '        sasl: "scram_sha512"' '        tls: "enable"' \
     '        offsetResetPolicy: "earliest"' '    - parameter: ca' '      name: "kafka-client-tls"' '      key: "ca.crt"' \
     '    - parameter: cert' '    - parameter: key' '    - parameter: keyPassword' '      key: "key-password"' \
     '    - parameter: username' '      name: "kafka-credentials"' '      key: "user"' \
     '        security.protocol: SASL_SSL' '        sasl.mechanism: SCRAM-SHA-512' \
     '        ssl.ca.location: /etc/kiw/kafka-tls/ca.crt' '        ssl.key.location: /etc/kiw/kafka-tls/tls.key' \
     '        ssl.key.password: ${env:KIW_KAFKA_KEY_PASSWORD}' '        sasl.password: ${env:KIW_SASL_PASSWORD}'; then
  pass "SASL_SSL + client certificate from secrets: worker config, and the same Secret keys in the TriggerAuthentication"
else
  fail "SASL_SSL + client certificate from secrets: worker config, and the same Secret keys in the TriggerAuthentication" \
    "$(grep -nE 'sasl|tls:|ssl\.|security\.protocol|offsetResetPolicy|parameter:' "$work/all-on-keda.yaml")"
fi
# TLS without SASL: the TriggerAuthentication (CA only) is rendered and referenced; no sasl in the trigger.
good_case keda-tls-only --set autoscaling.enabled=true \
  --set 'config.kafka.consumer.security\.protocol=SSL' --set 'config.kafka.consumer.ssl\.ca\.location=/etc/ca/ca.crt' \
  --set 'extraVolumes[0].name=ca' --set 'extraVolumes[0].secret.secretName=kafka-ca' \
  --set 'extraVolumeMounts[0].name=ca' --set 'extraVolumeMounts[0].mountPath=/etc/ca' \
  --set 'autoscaling.keda.extraSecretTargetRefs[0].parameter=ca' \
  --set 'autoscaling.keda.extraSecretTargetRefs[0].name=kafka-ca' --set 'autoscaling.keda.extraSecretTargetRefs[0].key=ca.crt'
if has_all "$work/keda-tls-only.yaml" 'kind: TriggerAuthentication' '    - parameter: ca' '        tls: "enable"' \
     '        name: kiw-kafka-inference-worker-kafka' && ! grep -qE 'sasl:|parameter: username' "$work/keda-tls-only.yaml"; then
  pass "KEDA TLS without SASL: TriggerAuthentication with the CA only"
else
  fail "KEDA TLS without SASL: TriggerAuthentication with the CA only" \
    "$(grep -nE 'kind:|sasl:|tls:|parameter:|authenticationRef' "$work/keda-tls-only.yaml")"
fi
# offsetResetPolicy follows auto.offset.reset (librdkafka's synonyms too), in the config or through extraEnv.
render keda-reset-latest --set autoscaling.enabled=true --set 'config.kafka.consumer.auto\.offset\.reset=latest'
render keda-reset-env --set autoscaling.enabled=true \
  --set 'extraEnv[0].name=WORKER__KAFKA__CONSUMER__AUTO_OFFSET_RESET' --set-string 'extraEnv[0].value=largest'
if has_all "$work/keda-reset-latest.yaml" '        offsetResetPolicy: "latest"' \
   && has_all "$work/keda-reset-env.yaml" '        offsetResetPolicy: "latest"' \
   && has_all "$work/keda-plain.yaml" '        offsetResetPolicy: "earliest"'; then
  pass "KEDA offsetResetPolicy follows kafka.consumer.auto.offset.reset (and its extraEnv override)"
else
  fail "KEDA offsetResetPolicy follows kafka.consumer.auto.offset.reset (and its extraEnv override)" \
    "$(grep -n offsetResetPolicy "$work"/keda-reset-*.yaml "$work/keda-plain.yaml"; cat "$work"/keda-reset-*.err)"
fi
render keda-scram256 --set autoscaling.enabled=true --set secrets.kafkaSasl.enabled=true --set secrets.kafkaSasl.secretName=s \
  --set 'config.kafka.consumer.security\.protocol=SASL_PLAINTEXT' --set 'config.kafka.consumer.sasl\.mechanism=SCRAM-SHA-256'
if has_all "$work/keda-scram256.yaml" '        sasl: "scram_sha256"' && ! grep -q ' tls:' "$work/keda-scram256.yaml"; then
  pass "KEDA sasl follows kafka.consumer.sasl.mechanism (SCRAM-SHA-256 -> scram_sha256, no TLS)"
else
  fail "KEDA sasl follows kafka.consumer.sasl.mechanism (SCRAM-SHA-256 -> scram_sha256, no TLS)" \
    "$(grep -nE 'sasl:|tls:' "$work/keda-scram256.yaml"; cat "$work/keda-scram256.err")"
fi
# The probes need the metrics server on the pod IP; "::" is fine, and without probes a loopback bind is allowed.
if render metrics-host-any6 --set config.metrics.host=:: \
   && render metrics-loopback-no-probes --set config.metrics.host=127.0.0.1 --set probes.startup.enabled=false \
        --set probes.liveness.enabled=false --set probes.readiness.enabled=false; then
  pass "metrics.host :: with probes, 127.0.0.1 without probes: render"
else
  fail "metrics.host :: with probes, 127.0.0.1 without probes: render" "$(cat "$work"/metrics-*.err)"
fi

# ------------------------------------------------------------------------------- 4. negative cases
echo "negative cases"
bad_render() {  # bad_render NAME EXPECTED-SUBSTRING [helm args...]
  local name=$1 expect=$2; shift 2
  if render "$name" "$@"; then
    fail "$name: rendered, expected a failure mentioning '$expect'"
  elif grep -qF -- "$expect" "$work/$name.err"; then
    pass "$name: helm template fails ($expect)"
  else
    fail "$name: failed without mentioning '$expect'" "$(cat "$work/$name.err")"
  fi
}
bad_render replicas-over-partitions "exceeds autoscaling.partitions" \
  --set autoscaling.enabled=true --set autoscaling.partitions=4 --set autoscaling.maxReplicas=8
bad_render hpa-over-partitions "exceeds autoscaling.partitions" \
  --set autoscaling.enabled=true --set autoscaling.kind=hpa --set autoscaling.partitions=2 --set autoscaling.maxReplicas=3
bad_render processes-zero "processes" --set processes=0
bad_render grace-below-shutdown "must be at least config.delivery.shutdown_timeout_s" \
  --set terminationGracePeriodSeconds=30
# shutdown + preStop + 1 s is not enough: a stop takes up to about 13 s past shutdown_timeout_s.
bad_render grace-below-overhead "= 48: the worker's stop takes up to shutdown_timeout_s + about 13 s" \
  --set terminationGracePeriodSeconds=47
bad_render grace-margin-below-overhead "terminationGraceMarginSeconds=12 must be at least 13" \
  --set terminationGraceMarginSeconds=12
bad_render grace-below-env-shutdown "must be at least config.delivery.shutdown_timeout_s" \
  --set terminationGracePeriodSeconds=60 --set 'extraEnv[0].name=WORKER__DELIVERY__SHUTDOWN_TIMEOUT_S' \
  --set-string 'extraEnv[0].value=120'
bad_render unknown-config-section "batchng" --set config.batchng.max_in_flight=1
bad_render bad-autoscaling-kind "autoscaling/kind" --set autoscaling.kind=vpa
bad_render sasl-without-secret "secrets.kafkaSasl.secretName" --set secrets.kafkaSasl.enabled=true
bad_render hpa-to-zero "minReplicas >= 1" \
  --set autoscaling.enabled=true --set autoscaling.kind=hpa --set autoscaling.minReplicas=0
bad_render probes-without-metrics "config.metrics.enabled=false" --set config.metrics.enabled=false
bad_render no-input-topics "no input topics" --set 'config.kafka.input_topics=null'
bad_render probes-loopback-host "config.metrics.host=127.0.0.1" --set config.metrics.host=127.0.0.1
bad_render probes-env-loopback-host "config.metrics.host=127.0.0.1 (or an extraEnv WORKER__METRICS__HOST)" \
  --set 'extraEnv[0].name=WORKER__METRICS__HOST' --set-string 'extraEnv[0].value=127.0.0.1'
bad_render probes-env-metrics-off "config.metrics.enabled=false" \
  --set 'extraEnv[0].name=WORKER__METRICS__ENABLED' --set-string 'extraEnv[0].value=false'
# A private CA (or a client certificate) in the worker config that KEDA is not given: KEDA cannot read the lag.
# (TLS set up by hand in config.kafka.consumer, not through secrets.kafkaTls, which gives KEDA the same files.)
manual_tls=(-f "$here/values-all-on.yaml" --set secrets.kafkaTls.enabled=false --set secrets.kafkaSasl.mechanism=
  --set 'config.kafka.consumer.security\.protocol=SASL_SSL' --set 'config.kafka.consumer.sasl\.mechanism=SCRAM-SHA-512')
bad_render keda-tls-without-ca "config.kafka.consumer.ssl.ca.location is set" "${manual_tls[@]}" \
  --set 'config.kafka.consumer.ssl\.ca\.location=/etc/kafka-ca/ca.crt'
# A public CA named by its system bundle path needs nothing from KEDA (it trusts the same bundle); nor does any
# path with systemCA: true.
if render keda-system-bundle "${manual_tls[@]}" \
     --set 'config.kafka.consumer.ssl\.ca\.location=/etc/ssl/certs/ca-certificates.crt' \
   && render keda-system-ca-flag "${manual_tls[@]}" --set 'config.kafka.consumer.ssl\.ca\.location=/etc/kafka-ca/ca.crt' \
     --set autoscaling.keda.systemCA=true; then
  pass "KEDA without a CA: a system bundle path, or systemCA: true, renders"
else
  fail "KEDA without a CA: a system bundle path, or systemCA: true, renders" "$(cat "$work"/keda-system-*.err)"
fi
bad_render keda-client-cert-missing "config.kafka.consumer.ssl.certificate.location is set" "${manual_tls[@]}" \
  --set 'config.kafka.consumer.ssl\.certificate\.location=/etc/kafka-ca/client.crt' \
  --set 'autoscaling.keda.extraSecretTargetRefs[0].parameter=ca' \
  --set 'autoscaling.keda.extraSecretTargetRefs[0].name=kafka-ca' --set 'autoscaling.keda.extraSecretTargetRefs[0].key=ca.crt'
bad_render keda-cert-without-key "cert and key together" --set autoscaling.enabled=true \
  --set 'autoscaling.keda.extraSecretTargetRefs[0].parameter=cert' \
  --set 'autoscaling.keda.extraSecretTargetRefs[0].name=c' --set 'autoscaling.keda.extraSecretTargetRefs[0].key=tls.crt'
bad_render keda-ref-twice "parameter ca is given twice (also by secrets.kafkaTls)" -f "$here/values-all-on.yaml" \
  --set 'autoscaling.keda.extraSecretTargetRefs[0].parameter=ca' \
  --set 'autoscaling.keda.extraSecretTargetRefs[0].name=c' --set 'autoscaling.keda.extraSecretTargetRefs[0].key=ca.crt'
bad_render keda-reset-error "auto.offset.reset=error has no KEDA equivalent" --set autoscaling.enabled=true \
  --set 'config.kafka.consumer.auto\.offset\.reset=error'
bad_render strategy-type "updateStrategy/type" --set updateStrategy.type=BlueGreen
# One fixed transactional.id in two pods: they fence each other.
bad_render eos-fixed-id-replicas "but replicaCount=2: two pods with one transactional.id fence each other" \
  --set config.delivery.mode=exactly_once --set config.delivery.transactional_id=kiw-tx --set replicaCount=2 \
  --set updateStrategy.type=Recreate
bad_render eos-fixed-id-autoscaling "but autoscaling.enabled with maxReplicas=6" \
  --set config.delivery.mode=exactly_once --set config.delivery.transactional_id=kiw-tx --set autoscaling.enabled=true \
  --set updateStrategy.rollingUpdate.maxSurge=0 --set updateStrategy.rollingUpdate.maxUnavailable=1
bad_render eos-fixed-id-surge "maxSurge=1 starts a new pod beside the old one" \
  --set config.delivery.mode=exactly_once --set config.delivery.transactional_id=kiw-tx
bad_render eos-env-fixed-id 'WORKER__DELIVERY__TRANSACTIONAL_ID="kiw-tx" in extraEnv is one transactional.id for every pod' \
  --set replicaCount=2 --set updateStrategy.type=Recreate \
  --set 'extraEnv[0].name=WORKER__DELIVERY__MODE' --set-string 'extraEnv[0].value=exactly_once' \
  --set 'extraEnv[1].name=WORKER__DELIVERY__TRANSACTIONAL_ID' --set-string 'extraEnv[1].value=kiw-tx'
# Topics KEDA cannot know (an override through valueFrom) or that the worker would refuse.
bad_render keda-topics-valuefrom "cannot read it at render time" --set autoscaling.enabled=true \
  --set 'extraEnv[0].name=WORKER__KAFKA__INPUT_TOPICS' --set 'extraEnv[0].valueFrom.configMapKeyRef.name=topics' \
  --set 'extraEnv[0].valueFrom.configMapKeyRef.key=input'
bad_render keda-lane-topics-valuefrom "WORKER__BATCHING__LANES__0__TOPICS may set the input topics" \
  --set autoscaling.enabled=true --set 'extraEnv[0].name=WORKER__BATCHING__LANES__0__TOPICS' \
  --set 'extraEnv[0].valueFrom.secretKeyRef.name=topics' --set 'extraEnv[0].valueFrom.secretKeyRef.key=input'
bad_render topics-env-not-a-list "is not a YAML list of topic names" \
  --set 'extraEnv[0].name=WORKER__KAFKA__INPUT_TOPICS' --set-string 'extraEnv[0].value=orders-v2'
bad_render topics-env-no-such-lane "the config has no batching.lanes[1]" \
  --set 'extraEnv[0].name=WORKER__BATCHING__LANES__1__TOPICS' --set-string 'extraEnv[0].value=[x]'
bad_render strategy-no-progress "maxSurge and maxUnavailable are both 0" \
  --set updateStrategy.rollingUpdate.maxSurge=0 --set updateStrategy.rollingUpdate.maxUnavailable=0

# The validator itself: manifests the API server would refuse must fail it (the default rendering, altered).
bad_manifest() {  # bad_manifest NAME EXPECTED-SUBSTRING PYTHON: bad_manifest_from on the default rendering
  bad_manifest_from default "$@"
}
bad_manifest_from() {  # bad_manifest_from BASE NAME EXPECTED-SUBSTRING PYTHON (alters `dep`, the Deployment, or `docs`)
  local base=$1 name=$2 expect=$3 code=$4
  "$PY" - "$work/$base.yaml" "$work/$name.yaml" "$code" <<'PYEOF'
import sys, yaml
docs = [d for d in yaml.safe_load_all(open(sys.argv[1])) if d]
dep = next(d for d in docs if d["kind"] == "Deployment")
exec(sys.argv[3])
yaml.safe_dump_all(docs, open(sys.argv[2], "w"))
PYEOF
  if out=$("$PY" "$here/validate_manifests.py" "${validate_args[@]}" "$work/$name.yaml" 2>&1); then
    fail "$name: validator passed it, expected a failure mentioning '$expect'"
  elif grep -qF -- "$expect" <<<"$out"; then
    pass "$name: validator refuses it ($expect)"
  else
    fail "$name: validator failed without mentioning '$expect'" "$out"
  fi
}
bad_manifest recreate-with-rolling-update "rollingUpdate: Forbidden" 'dep["spec"]["strategy"]["type"] = "Recreate"'
bad_manifest manifest-grace-below-overhead "does not cover preStop 5s + shutdown_timeout_s 30.0s + the worker's stop overhead 13s" \
  'dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 36'
bad_manifest volume-without-type "'tmp': must specify exactly one volume type" \
  'next(v for v in dep["spec"]["template"]["spec"]["volumes"] if v["name"] == "tmp")["emptyDir"] = None'

# A value the chart cannot judge but the worker rejects: check-config must exit 2 naming the key.
name=worker-rejects
if render "$name" --set config.batching.resume_ratio=1.5 \
   && "$PY" "$here/validate_manifests.py" --extract-config "$work/$name.config.yaml" "$work/$name.yaml" >/dev/null; then
  set +e; out=$(check_config "$work/$name.config.yaml" 2>&1); rc=$?; set -e
  if [ "$rc" = 2 ] && grep -qF '$.batching.resume_ratio' <<<"$out"; then
    pass "$name: worker check-config exit 2 ($out)"
  else
    fail "$name: worker check-config exit $rc, expected 2 naming \$.batching.resume_ratio" "$out"
  fi
else
  fail "$name: did not render" "$(cat "$work/$name.err")"
fi

# ------------------------------------------------------------------- 5. security, observability
source "$here/cases_security.sh"
source "$here/cases_observability.sh"

echo "$((checks - failures)) passed, $failures failed"
[ "$failures" = 0 ]
