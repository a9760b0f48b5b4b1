"""A lane with ``fill_with_lower``: its partial batches carry lower-lane records, and the runner reports every
record under its own lane (results, metrics), commits them all, and counts the batch under the leading
lane."""

from __future__ import annotations

import pytest

from tests.unit.fakes_kafka import Harness, make_config, request
from tests.unit.test_metrics import value
from worker.observability.metrics import PrometheusMetrics

LANES = {"lanes": [{"name": "hi", "priority": 1, "max_batch_size": 8, "fill_with_lower": True},
                   {"name": "lo", "max_batch_size": 8}], "default_lane": "lo"}


def test_a_filled_batch_reports_each_record_under_its_own_lane(monkeypatch: pytest.MonkeyPatch) -> None:
    m = PrometheusMetrics()
    h = Harness(monkeypatch, make_config(batching=LANES), metrics=m).start()
    h.c.assign(("in", 0))
    for i, lane in enumerate(["lo", "lo", "lo", "hi"]):
        h.c.append("in", 0, request(f"r{i}", i, priority=lane), timestamp_ms=1_000 + i)
    h.process()
    results = {r["id"]: r for r in h.p.results()}
    assert {k: r["lane"] for k, r in results.items()} == {"r0": "lo", "r1": "lo", "r2": "lo", "r3": "hi"}
    assert {r["batch_size"] for r in results.values()} == {4}  # one batch, led by the high record
    assert value(m, "kiw_batches_total", lane="hi", reason="idle") == 1
    assert value(m, "kiw_records_out_total", lane="lo", status="ok") == 3
    assert value(m, "kiw_records_out_total", lane="hi", status="ok") == 1
    assert value(m, "kiw_end_to_end_seconds_count", lane="lo") == 3
    assert value(m, "kiw_end_to_end_seconds_count", lane="hi") == 1
    h.runner.mode.commit(sync=True)
    assert h.c.committed_offsets.get(("in", 0)) == 4
