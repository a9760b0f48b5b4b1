"""Scrape /metrics, /healthz and /readyz of a running worker: counters move, histograms fill."""

from __future__ import annotations

import json
import re
import threading
import urllib.error
import urllib.request

import pytest

from tests.support.kafka_io import wait_for
from worker.app.load import produce, requests

pytestmark = pytest.mark.integration


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _value(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_metrics_move_and_health_endpoints(scenario, topic_names):
    bs, n = scenario.bootstrap, 6000
    scenario.topics(2)
    cfg = scenario.config(model={"name": "synthetic", "options": {"a_ms": 2, "b_ms": 0.05}},
                          metrics={"enabled": True, "port": 0, "host": "127.0.0.1", "lag_interval_s": 0.5})
    with scenario.worker(cfg) as w:
        wait_for(lambda: "metrics and health on port" in w.log(), 90, what="the metrics port in the log")
        port = int(re.search(r"metrics and health on port (\d+)", w.log()).group(1))  # type: ignore[union-attr]
        base = f"http://127.0.0.1:{port}"
        w.wait_assigned()
        assert _get(base + "/healthz")[0] == 200
        wait_for(lambda: _get(base + "/readyz")[0] == 200, 30, what="/readyz 200")
        feeder = threading.Thread(target=produce, args=(bs, topic_names["in"], requests(n, "synthetic")),
                                  kwargs={"rate": 1500})
        feeder.start()
        wait_for(lambda: _value(_get(base + "/metrics")[1], "kiw_records_in_total") > 0, 60,
                 what="records in")
        first = _get(base + "/metrics")[1]
        feeder.join(60)
        scenario.read_out(want=n, timeout=120)
        wait_for(lambda: _value(_get(base + "/metrics")[1], "kiw_records_out_total", status="ok") >= n, 30,
                 what="all results counted")
        second = _get(base + "/metrics")[1]
        status, body = _get(base + "/readyz")
    assert _value(second, "kiw_records_in_total", lane="default") > _value(first, "kiw_records_in_total",
                                                                           lane="default")
    assert _value(second, "kiw_records_out_total", lane="default", status="ok") == n
    for hist in ("kiw_batch_size", "kiw_batch_fill_ratio", "kiw_queue_wait_seconds", "kiw_inference_seconds",
                 "kiw_end_to_end_seconds"):
        assert _value(second, hist + "_count", lane="default") > 0, f"{hist} did not fill"
    assert _value(second, "kiw_commit_seconds_count") > 0
    assert "kiw_consumer_lag{" in second and "kiw_drain_seconds" in second
    assert _value(second, "kiw_model_loaded") == 1
    assert status == 200, body
    print(f"\n[metrics] ok={_value(second, 'kiw_records_out_total', status='ok'):.0f} "
          f"batches={_value(second, 'kiw_batch_size_count', lane='default'):.0f} "
          f"readyz={json.loads(body) if body.startswith('{') else body}")
