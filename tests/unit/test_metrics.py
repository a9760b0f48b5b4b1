from __future__ import annotations

import json
import math
import socket
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import needs
from worker.observability.health import HealthServer, HealthState
from worker.observability.metrics import DrainEstimator, PrometheusMetrics

EXPECTED = {
    # family name (as the parser reports it) -> (type, label names)
    "kiw_records_in": ("counter", {"lane"}),
    "kiw_records_out": ("counter", {"lane", "status"}),
    "kiw_batch_size": ("histogram", {"lane"}),
    "kiw_batch_fill_ratio": ("histogram", {"lane"}),
    "kiw_queue_wait_seconds": ("histogram", {"lane"}),
    "kiw_inference_seconds": ("histogram", {"lane"}),
    "kiw_end_to_end_seconds": ("histogram", {"lane"}),
    "kiw_in_flight": ("gauge", set()),
    "kiw_paused_partitions": ("gauge", set()),
    "kiw_consumer_lag": ("gauge", {"topic", "partition"}),
    "kiw_drain_seconds": ("gauge", set()),
    "kiw_commit_seconds": ("histogram", set()),
    "kiw_commit_failures": ("counter", set()),
    "kiw_dlq": ("counter", {"stage"}),
    "kiw_oom_splits": ("counter", {"lane"}),
    "kiw_redis_errors": ("counter", {"op"}),
    "kiw_redis_circuit_open": ("gauge", set()),
    "kiw_model_loaded": ("gauge", set()),
    "kiw_rebalances": ("counter", {"kind"}),
    "kiw_batches": ("counter", {"lane", "reason"}),
    "kiw_preemptions": ("counter", {"lane"}),
    "kiw_unknown_lane": ("counter", {"topic"}),
    "kiw_suspects_isolated": ("counter", set()),
    "kiw_ledger_skips": ("counter", set()),
    "kiw_producer_replacements": ("counter", set()),
    "kiw_lost_records_skipped": ("counter", set()),
}


def samples(m: PrometheusMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def value(m: PrometheusMetrics, name: str, **labels: str) -> float:
    return samples(m).get((name, frozenset(labels.items())), math.nan)


def exercise(m: PrometheusMetrics) -> None:
    m.records_in("hi", 3)
    m.records_out("hi", "ok", 2)
    m.batch("hi", size=8, fill_ratio=0.25, queue_wait_s=0.004, infer_s=0.03)
    m.end_to_end("hi", 0.05)
    m.dlq("decode")
    m.gauge("in_flight", 7)
    m.gauge("paused_partitions", 2)
    m.gauge("consumer_lag", 120, topic="req", partition="3")
    m.gauge("drain_seconds", 12.5)
    m.gauge("commit_seconds", 0.003)
    m.gauge("redis_circuit_open", 1)
    m.gauge("model_loaded", 1)
    m.event("commit_failures")
    m.event("oom_splits", lane="hi")
    m.event("redis_errors", op="get_cached")
    m.event("rebalances", kind="assign")
    m.event("batches", 4, lane="hi", reason="full")
    m.event("preemptions", lane="lo")
    m.event("unknown_lane", 2, topic="req")
    m.event("suspects_isolated", 3)
    m.event("ledger_skips", 4)


def test_every_metric_is_exposed_with_its_labels() -> None:
    m = PrometheusMetrics()
    exercise(m)
    fams = {f.name: f for f in text_string_to_metric_families(m.render().decode())}
    assert set(fams) == set(EXPECTED)
    for name, (kind, labels) in EXPECTED.items():
        assert fams[name].type == kind, name
        got = {k for s in fams[name].samples for k in s.labels if k not in ("le",)}
        assert got == labels, name


def test_counters_gauges_and_histograms_move() -> None:
    m = PrometheusMetrics()
    exercise(m)
    exercise(m)
    assert value(m, "kiw_records_in_total", lane="hi") == 6
    assert value(m, "kiw_records_out_total", lane="hi", status="ok") == 4
    assert value(m, "kiw_batches_total", lane="hi", reason="full") == 8
    assert value(m, "kiw_redis_errors_total", op="get_cached") == 2
    assert value(m, "kiw_dlq_total", stage="decode") == 2
    assert value(m, "kiw_commit_failures_total") == 2
    assert value(m, "kiw_in_flight") == 7
    assert value(m, "kiw_consumer_lag", topic="req", partition="3") == 120
    assert value(m, "kiw_commit_seconds_count") == 2
    assert value(m, "kiw_batch_size_bucket", lane="hi", le="8.0") == 2
    assert value(m, "kiw_batch_size_bucket", lane="hi", le="4.0") == 0
    assert value(m, "kiw_end_to_end_seconds_sum", lane="hi") == pytest.approx(0.1)


def test_every_metric_name_the_worker_emits_exists() -> None:
    """The adapter drops a name it does not know with a debug line, so a typo or a metric never registered
    (store_gate's ``suspects_isolated`` and ``ledger_skips`` were) would silently never move."""
    import re
    from pathlib import Path

    from worker.observability.metrics import _short

    used: set[tuple[str, str]] = set()
    for f in (Path(__file__).resolve().parents[2] / "worker").rglob("*.py"):
        used |= set(re.findall(r'\.(event|gauge|observe)\(\s*"([a-z_]+)"', f.read_text()))
    m = PrometheusMetrics()
    known = {"event": set(m._counters), "gauge": set(m._gauges) | set(m._histograms),
             "observe": set(m._histograms)}
    assert ("event", "ledger_skips") in used and ("gauge", "consumer_lag") in used  # the scan finds them
    assert sorted((kind, name) for kind, name in used if _short(name) not in known[kind]) == []


def test_buckets() -> None:
    m = PrometheusMetrics()
    m.batch("l", 1, 1.0, 0.0, 0.0)
    s = samples(m)
    les = sorted(float(dict(k[1])["le"]) for k in s if k[0] == "kiw_batch_size_bucket")
    assert les == [2.0**i for i in range(11)] + [math.inf]
    les = sorted(float(dict(k[1])["le"]) for k in s if k[0] == "kiw_inference_seconds_bucket")
    assert les[0] == 0.001 and les[-2] == 60.0


def test_generic_names_are_tolerant_and_never_raise() -> None:
    m = PrometheusMetrics()
    m.event("kiw_redis_errors_total", op="ping")  # full names work too
    m.gauge("kiw_in_flight", 3)
    m.event("no_such_metric", lane="x")
    m.gauge("no_such_gauge", 1.0)
    m.event("dlq")  # missing label -> ""
    m.event("rebalances", kind="revoke", extra="ignored")
    m.gauge("consumer_lag", 5, topic="t", partition=1)
    m.event("commit_failures", -1)  # counters cannot go down: ignored, not raised
    assert value(m, "kiw_redis_errors_total", op="ping") == 1
    assert value(m, "kiw_in_flight") == 3
    assert value(m, "kiw_dlq_total", stage="") == 1
    assert value(m, "kiw_rebalances_total", kind="revoke") == 1
    assert value(m, "kiw_consumer_lag", topic="t", partition="1") == 5
    assert value(m, "kiw_commit_failures_total") == 0
    m.remove_lag("t", 1)
    assert (("kiw_consumer_lag", frozenset({("topic", "t"), ("partition", "1")}))) not in samples(m)


def test_instances_have_separate_registries() -> None:
    a, b = PrometheusMetrics(), PrometheusMetrics()
    a.records_in("x")
    assert value(a, "kiw_records_in_total", lane="x") == 1
    assert math.isnan(value(b, "kiw_records_in_total", lane="x"))


# -- DrainEstimator -------------------------------------------------------------------------------------

def test_drain_zero_lag_is_zero_and_the_cap_means_stuck() -> None:
    d = DrainEstimator(window_s=10, cap_s=1000)
    assert d.estimate(0, now=0) == 0
    assert d.estimate(50, now=0) == 0  # nothing measured, nothing waiting: no evidence of slowness
    d.record(0, now=0, busy=True)
    assert d.estimate(50, now=5) == 0  # records waiting for 5 s of a 10 s window: not stuck yet
    d.record(0, now=10, busy=True)
    assert d.stuck(now=10) and d.estimate(50, now=10) == 1000  # a whole window waiting, none completed
    d.record(3, now=12, busy=True)  # progress: not stuck any more, and a rate is known
    assert not d.stuck(now=12) and d.estimate(50, now=12) < 1000


def test_drain_is_lag_over_recent_throughput() -> None:
    d = DrainEstimator(window_s=10, cap_s=10_000)
    d.record(0, now=0)
    for t in range(1, 11):
        d.record(100, now=t)  # 100 records/s
    assert d.throughput(now=10) == pytest.approx(100)
    assert d.estimate(5000, now=10) == pytest.approx(50)
    # Records still waiting and none completing: the rate falls as the busy seconds without progress fill the
    # window, and after a whole window without any the replica is stuck.
    for t in range(11, 20):
        d.record(0, now=t, busy=True)
    assert d.estimate(5000, now=19) == pytest.approx(500)  # 100 records in the window's 10 busy seconds
    d.record(0, now=20, busy=True)
    assert d.estimate(5000, now=20) == 10_000


def test_drain_idle_time_does_not_dilute_the_rate() -> None:
    """A burst after an idle hour is drained at the replica's speed, not at a sixtieth of it; with no busy
    time in the window the last measured rate stands (the cap would send an HPA to its maximum)."""
    d = DrainEstimator(window_s=60, cap_s=86_400)
    d.record(0, now=0, busy=True)
    d.record(500, now=5, busy=False)  # 100 records/s while busy
    for t in range(10, 3600, 5):
        d.record(0, now=t, busy=False)  # an idle hour
    assert d.throughput(now=3600) == 0  # no busy time in the window
    d.record(0, now=3600, busy=True)  # a burst: read, not finished at this report
    assert d.estimate(1000, now=3600) == pytest.approx(10)  # 1000 records at the last rate, 100/s
    d.record(200, now=3605, busy=False)  # done in that interval: 200 records in a 5 s busy interval
    assert d.throughput(now=3605) == pytest.approx(40)
    # Lag that nothing waits on (a transaction marker the commit cannot pass) never reads as stuck.
    for t in range(3610, 3800, 5):
        d.record(0, now=t, busy=False)
    assert d.estimate(1, now=3800) == pytest.approx(1 / 40)


def test_drain_rejects_bad_input() -> None:
    with pytest.raises(ValueError):
        DrainEstimator(window_s=0)
    with pytest.raises(ValueError):
        DrainEstimator().record(-1, now=0)


# -- HealthServer -----------------------------------------------------------------------------------------

def get(url: str) -> tuple[int, bytes, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read(), r.headers["Content-Type"]
    except urllib.error.HTTPError as e:
        return e.code, e.read(), e.headers["Content-Type"]


def test_health_endpoints() -> None:
    m = PrometheusMetrics()
    m.records_in("default", 2)
    state = HealthState()
    with HealthServer(m, "127.0.0.1", 0, state, heartbeat_timeout_s=30) as hs:
        assert hs.port != 0
        code, body, ctype = get(f"{hs.url}/metrics")
        assert code == 200 and ctype.startswith("text/plain")
        assert b'kiw_records_in_total{lane="default"} 2.0' in body
        assert b"kiw_model_loaded 0.0" in body

        assert get(f"{hs.url}/healthz")[0] == 200
        state.heartbeat = time.monotonic() - 31
        code, body, _ = get(f"{hs.url}/healthz")
        assert code == 503 and json.loads(body)["status"] == "stalled"
        state.beat()
        assert get(f"{hs.url}/healthz")[0] == 200

        code, body, ctype = get(f"{hs.url}/readyz")
        assert code == 503 and ctype == "application/json"
        assert json.loads(body)["failed"] == ["model_loaded", "broker_reachable", "assignment"]
        state.model_loaded = state.broker_reachable = True
        state.waiting_for_assignment = True
        assert get(f"{hs.url}/readyz")[0] == 200
        state.waiting_for_assignment = False
        assert json.loads(get(f"{hs.url}/readyz")[1])["failed"] == ["assignment"]
        state.assigned = True
        assert get(f"{hs.url}/readyz/")[0] == 200

        assert get(f"{hs.url}/nope")[0] == 404
        port = hs.port
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1)


def test_end_to_end_many_matches_observe_one_by_one() -> None:
    values = [-0.5, 0.0, 0.0004, 0.001, 0.0025, 0.01, 0.05, 0.099, 0.1, 0.7, 3.0, 42.0, 1e9]
    one, many = PrometheusMetrics(), PrometheusMetrics()
    for v in values:
        one.end_to_end("hi", v)
    many.end_to_end_many("hi", values[:5])
    many.end_to_end_many("hi", values[5:])
    def e2e(m: PrometheusMetrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        return {k: v for k, v in samples(m).items() if k[0].startswith("kiw_end_to_end_seconds")}
    got, want = e2e(many), e2e(one)
    assert got == want
    assert want[("kiw_end_to_end_seconds_count", frozenset({("lane", "hi")}))] == len(values)


def test_readme_metrics_table_matches_what_is_exported() -> None:
    """The Operating page's table is the operator's reference: same names (counters with ``_total``), types,
    labels."""
    import re

    from tests.support.readme import section

    readme = section("operating")
    table = readme[readme.index("## Metrics"):readme.index("## Queries")]
    documented = {}
    for name, kind, labels in re.findall(r"^\| `(kiw_[a-z_]+)` \| (\w+) \|([^|]*)\|", table, re.M):
        family = name.removesuffix("_total") if kind == "counter" else name
        documented[family] = (kind, set(re.findall(r"`(\w+)`", labels)))
    assert documented == EXPECTED


def test_the_health_server_binds_ipv6_and_serves_ipv4_too_on_the_any_address() -> None:
    # metrics.host "::" (what the chart accepts for dual-stack and IPv6 clusters) made the worker exit at
    # start: the server was IPv4 only ("address family for hostname not supported").
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError as e:
        needs.missing(f"this machine has no IPv6 loopback (a container without it, say): {e}")
    with HealthServer(PrometheusMetrics(), "::", 0, HealthState(), heartbeat_timeout_s=30) as hs:
        assert hs.url == f"http://[::1]:{hs.port}"
        assert get(f"{hs.url}/healthz")[0] == 200
        assert get(f"http://127.0.0.1:{hs.port}/healthz")[0] == 200  # dual stack: IPv4 probes reach it too
    with HealthServer(PrometheusMetrics(), "::1", 0, HealthState(), heartbeat_timeout_s=30) as hs:
        assert get(f"http://[::1]:{hs.port}/healthz")[0] == 200
