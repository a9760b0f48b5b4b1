"""What the chart renders to watch the worker, checked against the worker itself.

- The PrometheusRule's expressions use only metrics the worker exposes (worker/observability/metrics.py), and
  every metric the docs' "What to alert on" names has an alert.
- The dashboard ConfigMap carries deploy/grafana's dashboard as it is, for the Grafana sidecar.
- The exec probes and the `helm test` script, as rendered, run against the worker's real health server: they
  pass when it is ready and fail when it is not.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helm_render import ROOT, one, render

from worker.observability.health import HealthServer, HealthState
from worker.observability.metrics import PrometheusMetrics

pytestmark = pytest.mark.timeout(300)
DASHBOARD = ROOT / "deploy" / "grafana" / "dashboards" / "kafka-inference-worker.json"


def _exposed() -> set[str]:
    """Every series name the worker's /metrics can carry."""
    names: set[str] = set()
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    for family in PrometheusMetrics().registry.collect():
        names |= {family.name + s for s in suffixes[family.type]}
    return names


def _rules(*args: str) -> list[dict[str, str]]:
    docs = render("--set", "prometheusRule.enabled=true", *args)
    rule = one(docs, "PrometheusRule")
    return [r for g in rule["spec"]["groups"] for r in g["rules"]]


def test_alert_expressions_use_the_worker_metrics() -> None:
    rules = _rules()
    assert len(rules) == 7
    exposed = _exposed()
    for r in rules:
        used = set(re.findall(r"\bkiw_\w+", r["expr"]))
        assert used, r
        assert used <= exposed, f"{r['alert']}: {used - exposed} are not metrics of the worker"
        assert 'namespace="inference",job="kiw-kafka-inference-worker-metrics"' in r["expr"], r["expr"]


def test_documented_alerts_have_rules() -> None:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    # From "What to alert on" to the next heading: a paragraph or a list.
    paragraphs = [m.group(0) for page in pages if page.exists()
                  for m in re.finditer(r"[Ww]hat to alert on.*?(?=\n#|\Z)", page.read_text(), re.DOTALL)]
    assert paragraphs, "no 'What to alert on' section in README.md or docs/: the alerts to cover are unknown"
    documented = {m for p in paragraphs for m in re.findall(r"\bkiw_\w+", p)}
    assert len(documented) >= 7, documented
    covered = {m for r in _rules() for m in re.findall(r"\bkiw_\w+", r["expr"])}
    assert documented <= covered, f"documented alerts without a rule: {documented - covered}"


def test_alert_values_disable_and_tune() -> None:
    rules = _rules("--set", "prometheusRule.alerts.deadLetters.enabled=false",
                   "--set", "prometheusRule.alerts.drainTimeHigh.threshold=42", "--set",
                   "prometheusRule.selector=job=\"x\"")
    by_name = {r["alert"]: r for r in rules}
    assert "KiwDeadLetters" not in by_name
    assert by_name["KiwDrainTimeHigh"]["expr"] == 'max by (namespace, pod) (kiw_drain_seconds{job="x"}) > 42'
    assert "for" not in by_name["KiwProducerReplaced"]  # 0m: fires at the first increase


def test_dashboard_configmap_is_the_deploy_dashboard() -> None:
    docs = render("--set", "grafanaDashboard.enabled=true", "--set", "grafanaDashboard.namespace=monitoring")
    cm = one(docs, "ConfigMap", suffix="-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["data"]["kafka-inference-worker.json"].strip() == DASHBOARD.read_text().strip()
    dashboard = json.loads(cm["data"]["kafka-inference-worker.json"])
    used = set(re.findall(r"\bkiw_\w+", json.dumps(dashboard)))
    assert used and used <= _exposed(), used - _exposed()


@pytest.fixture()
def health() -> tuple[HealthServer, PrometheusMetrics]:
    metrics = PrometheusMetrics()
    server = HealthServer(metrics, host="127.0.0.1", port=0, state=HealthState()).start()
    yield server, metrics
    server.stop()


def _run(cmd: list[str]) -> subprocess.CompletedProcess[str]:
    assert cmd[0] == "python3"
    return subprocess.run([sys.executable, *cmd[1:]], capture_output=True, text=True, timeout=60)


def test_exec_probes_call_the_health_server(health: tuple[HealthServer, PrometheusMetrics]) -> None:
    server, _ = health
    dep = one(render("--set", "probes.mode=exec", "--set", "config.metrics.host=127.0.0.1"), "Deployment")
    worker = dep["spec"]["template"]["spec"]["containers"][0]
    cmds = {p: [c.replace(":9400/", f":{server.port}/") for c in worker[p]["exec"]["command"]]
            for p in ("startupProbe", "livenessProbe", "readinessProbe")}
    assert _run(cmds["livenessProbe"]).returncode == 0  # the heartbeat is fresh
    assert _run(cmds["readinessProbe"]).returncode == 1  # no model, no broker yet: 503
    assert _run(cmds["startupProbe"]).returncode == 1
    state = server.state
    state.model_loaded, state.broker_reachable, state.waiting_for_assignment = True, True, True
    assert _run(cmds["readinessProbe"]).returncode == 0
    assert _run(cmds["startupProbe"]).returncode == 0
    state.heartbeat -= 3600  # a stuck loop
    assert _run(cmds["livenessProbe"]).returncode == 1


def test_helm_test_pod_checks_readiness_and_model(health: tuple[HealthServer, PrometheusMetrics]) -> None:
    server, metrics = health
    pod = one(render("--set", "test.timeoutSeconds=1"), "Pod")
    (container,) = pod["spec"]["containers"]
    script = container["args"][0]
    base = "http://kiw-kafka-inference-worker-metrics.inference.svc:9400"
    assert base in script and container["command"] == ["python3", "-c"]
    cmd = ["python3", "-c", script.replace(base, server.url)]
    not_ready = _run(cmd)
    assert not_ready.returncode == 1 and "FAIL" in not_ready.stderr and "503" in not_ready.stderr
    state = server.state
    state.model_loaded, state.broker_reachable, state.assigned = True, True, True
    not_loaded = _run(cmd)  # ready, but the gauge says no model
    assert not_loaded.returncode == 1 and "kiw_model_loaded is 0.0" in not_loaded.stderr
    metrics.gauge("model_loaded", 1.0)
    ok = _run(cmd)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("ok: /readyz 200, kiw_model_loaded 1")


def test_dashboard_file_is_linked_not_copied() -> None:
    link = ROOT / "helm" / "kafka-inference-worker" / "dashboards" / "kafka-inference-worker.json"
    assert link.is_symlink() and Path(link.resolve()) == DASHBOARD.resolve()
