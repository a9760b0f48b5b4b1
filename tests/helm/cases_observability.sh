# Chart cases for what watches the worker (sourced by check_chart.sh; uses its helpers): the PrometheusRule, the
# Grafana dashboard ConfigMap, the NetworkPolicy on the metrics port, the helm test pod, exec probes with the
# metrics bound to the loopback address, and the pod extras (runtimeClassName, init and extra containers).
echo "observability, network policy, helm test, pod extras"

good_case observability --set prometheusRule.enabled=true --set grafanaDashboard.enabled=true \
  --set networkPolicy.enabled=true
if has_all "$work/observability.yaml" 'kind: PrometheusRule' '        - alert: KiwDrainTimeHigh' \
     '        - alert: KiwProducerReplaced' '    grafana_dashboard: "1"' '  kafka-inference-worker.json: |-' \
     'kind: NetworkPolicy' '        - port: metrics' '              app.kubernetes.io/component: helm-test' \
     '    helm.sh/hook: test'; then
  pass "PrometheusRule, dashboard ConfigMap, NetworkPolicy (test pod let in), helm test pod render"
else
  fail "PrometheusRule, dashboard ConfigMap, NetworkPolicy (test pod let in), helm test pod render" \
    "$(grep -nE '^kind:|alert:|grafana|port:|hook' "$work/observability.yaml")"
fi
# Off by default: neither the rule, the dashboard nor the policy; the test pod is on.
if ! grep -qE '^kind: (PrometheusRule|NetworkPolicy)$|grafana_dashboard' "$work/default.yaml" \
   && has_all "$work/default.yaml" 'kind: Pod' && render no-test --set test.enabled=false \
   && ! grep -q '^kind: Pod$' "$work/no-test.yaml"; then
  pass "PrometheusRule, dashboard and NetworkPolicy off by default; test.enabled=false drops the test pod"
else
  fail "PrometheusRule, dashboard and NetworkPolicy off by default; test.enabled=false drops the test pod"
fi
# A disabled alert is left out; thresholds, durations and alert labels follow the values (values-all-on.yaml).
if has_all "$work/all-on-keda.yaml" '        - alert: KiwNoThroughput' '          for: 5m' '            team: "ml-platform"' \
     '            severity: "critical"' '  namespace: monitoring' '    grafana_folder: Inference' '    - Egress' \
   && grep -qF 'kiw_drain_seconds{namespace=\"inference\",job=\"kiw-kafka-inference-worker-metrics\"}) > 120' \
        "$work/all-on-keda.yaml" \
   && ! grep -q 'alert: KiwDeadLetters' "$work/all-on-keda.yaml"; then
  pass "alerts follow prometheusRule.alerts (threshold, for, severity, disabled), extraRules appended"
else
  fail "alerts follow prometheusRule.alerts (threshold, for, severity, disabled), extraRules appended" \
    "$(grep -nE 'alert:|for:|severity|kiw_drain' "$work/all-on-keda.yaml")"
fi
# Metrics on the loopback address: exec probes from inside the container; the Service then targets a proxy port,
# which Prometheus scrapes over https (the helm test speaks plain HTTP: off).
good_case loopback-exec-probes --set probes.mode=exec --set config.metrics.host=127.0.0.1 \
  --set networkPolicy.enabled=true --set 'networkPolicy.metricsFrom[0].namespaceSelector.matchLabels.team=obs' \
  --set service.targetPort=https-metrics --set test.enabled=false \
  --set serviceMonitor.enabled=true --set serviceMonitor.scheme=https \
  --set serviceMonitor.tlsConfig.insecureSkipVerify=true \
  --set 'extraContainers[0].name=proxy' --set 'extraContainers[0].image=registry.example.com/proxy:1' \
  --set 'extraContainers[0].ports[0].name=https-metrics' --set 'extraContainers[0].ports[0].containerPort=9443'
if grep -qF "urllib.request.urlopen('http://127.0.0.1:9400/readyz', timeout=3)" "$work/loopback-exec-probes.yaml" \
   && has_all "$work/loopback-exec-probes.yaml" '      targetPort: https-metrics' '        - port: https-metrics' \
        '      scheme: https' '        insecureSkipVerify: true' \
   && ! grep -q 'httpGet' "$work/loopback-exec-probes.yaml"; then
  pass "probes.mode exec with metrics on 127.0.0.1; Service and NetworkPolicy on the proxy port"
else
  fail "probes.mode exec with metrics on 127.0.0.1; Service and NetworkPolicy on the proxy port" \
    "$(grep -nE 'Probe|exec|command|targetPort|port:' "$work/loopback-exec-probes.yaml")"
fi
# runtimeClassName, initContainers, extraContainers (values-all-on.yaml).
if has_all "$work/all-on-keda.yaml" '      runtimeClassName: nvidia' '      initContainers:' '          name: fetch-model' \
     '          name: metrics-proxy'; then
  pass "runtimeClassName, initContainers and extraContainers render"
else
  fail "runtimeClassName, initContainers and extraContainers render" \
    "$(grep -nE 'runtimeClassName|initContainers|name: (fetch-model|metrics-proxy)' "$work/all-on-keda.yaml")"
fi

bad_render exec-probes-pod-ip "probes.mode exec calls the loopback address" --set probes.mode=exec \
  --set config.metrics.host=10.1.2.3
bad_render probes-mode-unknown "probes/mode" --set probes.mode=tcpSocket
bad_render alert-for-not-a-duration "prometheusRule/alerts/partitionsPaused/for" \
  --set prometheusRule.enabled=true --set prometheusRule.alerts.partitionsPaused.for=soon
bad_render alert-unknown "prometheusRule/alerts" --set prometheusRule.alerts.diskFull.enabled=true
bad_render network-policy-bad-egress "networkPolicy/egress" --set networkPolicy.egress=all
bad_manifest_from observability network-policy-locks-test-out "does not let the helm test pod" '
np = next(d for d in docs if d["kind"] == "NetworkPolicy"); np["spec"]["ingress"][0]["from"] = []'
bad_manifest_from observability rule-other-job "which is no rendered Service" '
pr = next(d for d in docs if d["kind"] == "PrometheusRule")
pr["spec"]["groups"][0]["rules"][0]["expr"] = pr["spec"]["groups"][0]["rules"][0]["expr"].replace("-metrics", "-x")'
bad_manifest_from observability test-pod-other-service "does not call a port of a rendered Service" '
t = next(d for d in docs if d["kind"] == "Pod")
t["spec"]["containers"][0]["args"][0] = t["spec"]["containers"][0]["args"][0].replace(":9400", ":9999")'
