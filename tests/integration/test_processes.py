"""``worker run --processes 2`` on the real broker: two members of the group share the topic, every record
gets exactly one result, offsets reach the end, each process serves metrics on its own port, and a SIGTERM
drains both with exit 0."""

from __future__ import annotations

import re
import urllib.request

import pytest
from confluent_kafka.admin import AdminClient

from tests.support.kafka_io import WorkerProcess, decode, request, wait_for, worker_config

pytestmark = pytest.mark.integration


def group_members(bootstrap: str, group: str) -> list[str]:
    """The ids of the group's members with at least one partition assigned; none while the broker cannot
    say yet (the group's coordinator still loading, say)."""
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    try:
        desc = admin.describe_consumer_groups([group], request_timeout=5)[group].result(timeout=10)
    except Exception:  # noqa: BLE001 - asked again by wait_for
        return []
    return [m.member_id for m in desc.members if m.assignment.topic_partitions]


def test_two_processes_share_the_group_and_answer_every_record_once(scenario):
    bs, n = scenario.bootstrap, 4000
    scenario.topics(4)
    cfg = scenario.config(model={"name": "identity"}, metrics={"enabled": True, "port": 0})
    group = cfg["kafka"]["group_id"]
    with scenario.worker(cfg, extra_args=["--processes", "2"]) as w:
        # Both members hold partitions before any record exists: each record is then one member's.
        wait_for(lambda: len(group_members(bs, group)) == 2 or w.proc.poll() is not None, 120,
                 what="two members of the group with partitions")
        assert w.proc.poll() is None, w.log()[-4000:]
        ports = sorted({int(p) for p in re.findall(r"metrics and health on port (\d+)", w.log())})
        assert len(ports) == 2, w.log()[-4000:]
        for port in ports:
            assert urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5).status == 200
        scenario.produce([request(i) for i in range(n)])
        results = scenario.delivered(group, want=n, timeout=180)
    log = w.log()
    assert "supervising 2 worker processes" in log
    assert log.count("shutting down") >= 2, log[-4000:]  # both children drained
    ids = [v["id"] for v in decode(results)]
    again = [v["id"] for v in decode(scenario.read_out(timeout=30, idle=2))]
    assert len(again) == n, f"{len(again) - n} results beyond one per record"
    assert set(ids) == set(again) == {f"r-{i}" for i in range(n)}


def test_a_bad_port_range_is_refused_before_any_process_starts(kafka, topic_names, tmp_path):
    cfg = worker_config(kafka.bootstrap, topic_names, metrics={"enabled": True, "port": 65535})
    w = WorkerProcess(cfg, tmp_path, extra_args=["--processes", "2"]).start()
    try:
        assert w.wait(60) == 2
    finally:
        w.kill()
    assert "$.metrics.port: 2 processes serve metrics on ports 65535..65536" in w.log()
