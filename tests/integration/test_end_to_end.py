"""Walking skeleton on the real broker: 5,000 requests over 4 partitions, one malformed record."""

from __future__ import annotations

import pytest

from tests.support.kafka_io import decode, end_offsets, request

pytestmark = pytest.mark.integration


def test_5000_requests_exactly_once_each_and_offsets_committed(scenario, kafka, topic_names):
    print(f"\n[kafka] broker version: {kafka.version}")
    n = 5000
    scenario.topics(4)
    reqs = [request(i) for i in range(n)]
    # Spread over the 4 partitions explicitly; the malformed record sits in the middle of partition 2.
    for part in range(4):
        chunk = reqs[part::4]
        scenario.produce(chunk[: len(chunk) // 2], partition=part)
        if part == 2:
            scenario.produce([(b"broken", b'{"id": "broken", "inputs": [1, 2')], partition=2)
        scenario.produce(chunk[len(chunk) // 2:], partition=part)
    cfg = scenario.config()
    results, _ = scenario.serve(cfg, want=n, timeout=180)

    values = decode(results)
    ids = [v["id"] for v in values]
    assert len(ids) == n, f"expected exactly {n} results, got {len(ids)}"
    assert set(ids) == {f"r-{i}" for i in range(n)}
    assert all(v["status"] == "ok" and len(v["outputs"]) == 4 for v in values)
    # the result key is the request key
    assert all(m.key() == v["id"].encode() for m, v in zip(results, values, strict=True))

    dlq = scenario.read_dlq(want=1, timeout=30)
    assert len(dlq) == 1
    h = dict(dlq[0].headers())
    assert dlq[0].value() == b'{"id": "broken", "inputs": [1, 2'  # original bytes
    assert dlq[0].key() == b"broken"
    assert h["x-error-stage"] == b"decode" and h["x-source-partition"] == b"2"
    assert h["x-source-topic"] == topic_names["in"].encode() and h["x-error"].startswith(b"undecodable json")

    # Restart: everything is committed, so nothing old is processed again. One new request per partition
    # shows that the restarted worker read every partition from where it was committed: once their results
    # are out, it has consumed past anything it could have re-read, and a graceful stop delivers all of it.
    with scenario.worker(cfg, name="restart") as w2:
        w2.wait_assigned()
        for part in range(4):
            scenario.produce([request(part, prefix="after-restart")], partition=part)
        scenario.read_out(want=n + 4, timeout=60)
    again = [v["id"] for v in decode(scenario.read_out(timeout=30, idle=2))]
    assert len(again) == n + 4, f"restart reprocessed {len(again) - n - 4} records"
    assert set(again) == set(ids) | {f"after-restart-{p}" for p in range(4)}
    print(f"[e2e] results={len(ids)} dlq={len(dlq)} committed==end for 4 partitions; restart added 0")


def test_input_from_a_transactional_producer_is_committed_to_its_end(scenario, topic_names):
    """Each committed transaction leaves a marker after its records, an offset no consume returns. The worker
    commits the consumer's position past it once everything before it is done: committing "last record + 1"
    left a lag of 1 per partition for good (KEDA never scaled to zero; the HPA read an idle replica as
    busy)."""
    from confluent_kafka import Producer

    bs = scenario.bootstrap
    scenario.topics(2)
    p = Producer({"bootstrap.servers": bs, "transactional.id": f"upstream-{topic_names['in']}"})
    p.init_transactions(30)
    for t in range(2):
        p.begin_transaction()
        for i in range(10):
            key, value = request(t * 10 + i, prefix="txn")
            p.produce(topic_names["in"], value=value, key=key, partition=i % 2)
        p.commit_transaction(30)
    ends = end_offsets(bs, topic_names["in"])
    assert ends == {0: 12, 1: 12}  # 5 + marker, twice, per partition
    # Served to the end: the group's commits pass the last transaction marker.
    results, _ = scenario.serve(scenario.config(), want=20, timeout=120)
    assert len(results) == 20
