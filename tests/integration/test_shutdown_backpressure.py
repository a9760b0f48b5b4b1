"""Graceful shutdown and backpressure on the real broker."""

from __future__ import annotations

import collections
import signal
import time

import msgspec
import pytest

from tests.support.kafka_io import WorkerProcess, committed_offsets, create_topics, decode

pytestmark = pytest.mark.integration
enc = msgspec.json.encode


def _reqs(n: int, prefix: str) -> list[tuple[bytes, bytes]]:
    return [(f"{prefix}-{i}".encode(), enc({"id": f"{prefix}-{i}", "inputs": {"x": i}})) for i in range(n)]


def test_sigterm_mid_run_exits_0_loses_nothing_and_restart_resumes(scenario, topic_names, tmp_path):
    n = 3000
    scenario.topics(3)
    scenario.produce(_reqs(n, "s"))
    # ~16 records per 66 ms: about 12 s for the whole topic, so a stop 4 s in is mid-run.
    cfg = scenario.config(model={"name": "synthetic", "options": {"a_ms": 50, "b_ms": 1}},
                          batching={"lanes": [{"name": "default", "max_batch_size": 16, "max_wait_ms": 5}],
                                    "max_in_flight": 600})
    w = WorkerProcess(cfg, tmp_path, name="first").start()
    try:
        w.wait_assigned()
        time.sleep(4)
        w.signal(signal.SIGTERM)
        rc = w.wait(60)
    finally:
        w.kill()
    assert rc == 0, w.log()[-3000:]
    first = decode(scenario.read_out(timeout=20, idle=2))
    committed = committed_offsets(scenario.bootstrap, cfg["kafka"]["group_id"], topic_names["in"])
    assert sum(max(o, 0) for o in committed.values()) == len(first), \
        "after a graceful stop, every produced result is committed and nothing beyond"
    assert 0 < len(first) < n, "SIGTERM did not land mid-run; the test did not test a mid-run stop"

    with scenario.worker(cfg, name="second"):
        results = decode(scenario.read_out(want=n, timeout=180))
    ids = collections.Counter(r["id"] for r in results)
    dupes = sum(c - 1 for c in ids.values())
    print(f"\n[shutdown] before SIGTERM: {len(first)} results; after restart: {len(ids)} ids, "
          f"duplicates={dupes}")
    assert set(ids) == {f"s-{i}" for i in range(n)}
    assert dupes == 0, "a graceful shutdown finishes and commits in-flight work: no duplicates"


def test_model_slower_than_max_poll_interval_no_leave_no_redelivery(scenario, topic_names):
    n = 120
    create_topics(scenario.bootstrap, {topic_names["in"]: 2, topic_names["out"]: 1, topic_names["dlq"]: 1})
    scenario.produce(_reqs(n, "slow"))
    cfg = scenario.config(kafka={"consumer": {"max.poll.interval.ms": 10000, "session.timeout.ms": 6000,
                                              "heartbeat.interval.ms": 500}},
                          model={"name": "synthetic", "options": {"a_ms": 11000, "b_ms": 0}},
                          batching={"lanes": [{"name": "default", "max_batch_size": 60, "max_wait_ms": 1}],
                                    "max_in_flight": 60, "resume_ratio": 0.5},
                          logging={"level": "DEBUG", "format": "text"})
    with scenario.worker(cfg) as w:
        results = decode(scenario.read_out(want=n, timeout=120))
    log = w.log()
    ids = collections.Counter(r["id"] for r in results)
    print(f"\n[backpressure] {len(results)} results for {n} requests, batches of 11 s each")
    assert set(ids) == {f"slow-{i}" for i in range(n)}
    assert max(ids.values()) == 1, "a record was redelivered"
    for bad in ("MAX_POLL_EXCEEDED", "leaving group", "Application maximum poll interval"):
        assert bad not in log, f"consumer left the group: {bad!r} in the worker log"
    assert log.count("partitions assigned") == 1, "the worker was rebalanced during the run"
    assert "backpressure: 2 partitions paused" in log, "the bound on records in flight never paused fetching"
