"""Consistency of the deploy/ files: no Docker engine needed.

The dashboard, the docs and the metrics code must agree on metric names; compose, Prometheus, the
worker config and the Dockerfile must agree on ports, topics and paths.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from tests.support.readme import section
from worker.config import settings as worker_config
from worker.observability.metrics import PrometheusMetrics

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kafka-inference-worker.json"


def _registered() -> tuple[set[str], set[str]]:
    """Every kiw_ metric the worker registers, by exposed name (counters with their _total suffix, histograms
    without _bucket/_sum/_count), and the histograms among them. Read from the registry itself, so that a
    metric added to the code is held to the dashboard and docs checks below without editing this file."""
    names: set[str] = set()
    histograms: set[str] = set()
    for family in PrometheusMetrics().registry.collect():
        if not family.name.startswith("kiw_"):
            continue
        name = f"{family.name}_total" if family.type == "counter" else family.name
        names.add(name)
        if family.type == "histogram":
            histograms.add(name)
    return names, histograms


# The metrics contract.
METRICS, HISTOGRAMS = _registered()
_HIST_SUFFIX = re.compile(r"_(bucket|sum|count)$")


def _metric_names(text: str) -> set[str]:
    return {_HIST_SUFFIX.sub("", m) for m in re.findall(r"\bkiw_[a-z0-9_]+", text)}


def _dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _panels(dash: dict) -> list[dict]:
    return [p for p in dash["panels"] if p["type"] != "row"]


def _compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())


def _worker_cfg() -> worker_config.Config:
    return worker_config.load(DEPLOY / "config" / "worker.yaml", environ={})


# ------------------------------------------------------------------------------------------ dashboard
def test_the_registry_holds_the_metrics_contract() -> None:
    # A guard on _registered(): an empty or misread registry would make every check below pass vacuously.
    assert {"kiw_records_in_total", "kiw_consumer_lag", "kiw_end_to_end_seconds",
            "kiw_rebalances_total"} <= METRICS
    assert {"kiw_batch_size", "kiw_end_to_end_seconds", "kiw_commit_seconds"} <= HISTOGRAMS


def test_dashboard_uses_exactly_the_documented_metrics() -> None:
    exprs = [t["expr"] for p in _panels(_dashboard()) for t in p["targets"]]
    used = set().union(*(_metric_names(e) for e in exprs))
    assert used - METRICS == set(), f"dashboard queries unknown metrics: {sorted(used - METRICS)}"
    assert METRICS - used == set(), f"metrics without a panel: {sorted(METRICS - used)}"


def test_dashboard_histograms_are_queried_as_histograms() -> None:
    for p in _panels(_dashboard()):
        for t in p["targets"]:
            for name in HISTOGRAMS:
                bare = re.findall(rf"\b{name}\b(?!_)", t["expr"])
                assert not bare, f"panel {p['title']!r}: {name} used without _bucket/_sum/_count"


def test_dashboard_layout_and_datasource() -> None:
    dash = _dashboard()
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    assert dash["uid"] == "kafka-inference-worker"
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, f"panel {p['title']!r} overflows the grid"
    for p in _panels(dash):
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        assert p["targets"], f"panel {p['title']!r} has no query"
    titles = " ".join(p["title"].lower() for p in _panels(dash))
    for must in ("per lane", "batch size", "p99", "lag", "dlq", "in flight", "paused"):
        assert must in titles, f"no panel about {must!r}"


def test_operating_docs_list_every_metric() -> None:
    text = section("operating")
    assert METRICS - _metric_names(text) == set()


# --------------------------------------------------------------------------------- compose/prometheus
def test_compose_services_and_mounts() -> None:
    compose = _compose()
    services = compose["services"]
    assert {"kafka", "topic-init", "redis", "worker", "prometheus", "grafana", "load"} <= set(services)
    assert services["kafka"]["image"] == "apache/kafka:4.1.1"
    assert services["redis"]["image"].startswith("redis:7")
    build = services["worker"]["build"]
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == DEPLOY / "Dockerfile"
    for name, svc in services.items():
        for vol in svc.get("volumes", []):
            src = vol.split(":")[0]
            if src.startswith("."):
                assert (DEPLOY / src).exists(), f"{name}: bind mount {src} does not exist"
    assert services["worker"]["read_only"] is True
    assert services["load"]["profiles"] == ["load"]


def test_compose_worker_config_matches_topics_and_ports() -> None:
    cfg = _worker_cfg()
    services = _compose()["services"]
    script = services["topic-init"]["command"][0]
    for topic in [*cfg.input_topics(), cfg.kafka.output_topic, cfg.kafka.dlq_topic]:
        assert topic in script, f"topic-init does not create {topic!r}"
    kafka_env = services["kafka"]["environment"]
    assert cfg.kafka.bootstrap_servers in kafka_env["KAFKA_ADVERTISED_LISTENERS"]
    load = services["load"]["command"]
    assert load[0] == "load"
    assert load[load.index("--topic") + 1] in cfg.input_topics()
    assert load[load.index("--bootstrap") + 1] == cfg.kafka.bootstrap_servers
    lanes = {lane.name for lane in cfg.batching.lanes}
    mix = load[load.index("--lanes") + 1]
    default_mix = re.sub(r"^\$\{[A-Z_]+:-(.*)\}$", r"\1", mix)
    assert {part.split("=")[0] for part in default_mix.split(",")} <= lanes
    assert f"{cfg.metrics.port}:{cfg.metrics.port}" in services["worker"]["ports"]
    grace = int(services["worker"]["stop_grace_period"].rstrip("s"))
    assert grace > cfg.delivery.shutdown_timeout_s


def test_prometheus_scrapes_the_worker() -> None:
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    targets = [t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert f"worker:{_worker_cfg().metrics.port}" in targets


def test_grafana_provisioning_points_at_the_dashboard() -> None:
    prov = yaml.safe_load(
        (DEPLOY / "grafana" / "provisioning" / "dashboards" / "kafka-inference-worker.yml").read_text()
    )
    path = prov["providers"][0]["options"]["path"]
    mounts = _compose()["services"]["grafana"]["volumes"]
    assert any(m.endswith(f":{path}:ro") and m.startswith("./grafana/dashboards") for m in mounts)
    ds = yaml.safe_load((DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert ds["datasources"][0]["url"] == "http://prometheus:9090"


def test_compose_worker_config_is_valid() -> None:
    cfg = _worker_cfg()
    assert cfg.redis.url and cfg.redis.url.startswith("redis://redis:")
    assert {lane.name for lane in cfg.batching.lanes} == {"high", "low"}


# ----------------------------------------------------------------------------------------- Dockerfile
def test_dockerfile_contract() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    assert re.search(r"^ARG VARIANT=cpu$", text, re.M)
    assert re.search(r"^USER 10001:10001$", text, re.M)
    assert 'ENTRYPOINT ["worker"]' in text
    assert 'CMD ["run", "--config", "/etc/worker/config.yaml"]' in text
    assert re.search(r"^HEALTHCHECK .*\n?.*healthz", text, re.M) or "9400/healthz" in text
    assert "HF_HUB_OFFLINE=1" in text and "HOME=/tmp" in text and "TMPDIR=/tmp" in text
    assert 'pip install ".[models]"' in text
    assert "download.pytorch.org/whl/cpu" in text


def test_dockerfile_copies_only_what_the_ignore_file_lets_in() -> None:
    text = (DEPLOY / "Dockerfile").read_text()
    ignore = (DEPLOY / "Dockerfile.dockerignore").read_text().split()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    sources = []
    for m in re.finditer(r"^COPY (?!--from)(?:--\S+ )*(.+)$", text, re.M):
        sources += m.group(1).split()[:-1]
    assert sources, "no COPY from the build context"
    for src in sources:
        assert (ROOT / src).exists(), f"COPY {src}: not in the repository"
        assert src.rstrip("/") in allowed, f"COPY {src}: excluded by deploy/Dockerfile.dockerignore"
