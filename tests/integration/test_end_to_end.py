"""Walking skeleton on the real broker: 5,000 requests over 4 partitions, one malformed record."""

from __future__ import annotations

import pytest

from tests.support.kafka_io import (
    WorkerProcess,
    committed_offsets,
    create_topics,
    decode,
    end_offsets,
    produce_values,
    read_all,
    request,
    wait_for,
    worker_config,
)

pytestmark = pytest.mark.integration


def test_5000_requests_exactly_once_each_and_offsets_committed(kafka, topic_names, tmp_path):
    print(f"\n[kafka] broker version: {kafka.version}")
    bs, n = kafka.bootstrap, 5000
    create_topics(bs, {topic_names["in"]: 4, topic_names["out"]: 4, topic_names["dlq"]: 1})
    reqs = [request(i) for i in range(n)]
    # Spread over the 4 partitions explicitly; the malformed record sits in the middle of partition 2.
    for part in range(4):
        chunk = reqs[part::4]
        produce_values(bs, topic_names["in"], chunk[: len(chunk) // 2], partition=part)
        if part == 2:
            produce_values(bs, topic_names["in"], [(b"broken", b'{"id": "broken", "inputs": [1, 2')],
                           partition=2)
        produce_values(bs, topic_names["in"], chunk[len(chunk) // 2:], partition=part)
    cfg = worker_config(bs, topic_names)
    group = cfg["kafka"]["group_id"]

    w = WorkerProcess(cfg, tmp_path).start()
    try:
        results = read_all(bs, topic_names["out"], want=n, timeout=180)
        ends = end_offsets(bs, topic_names["in"])
        wait_for(lambda: committed_offsets(bs, group, topic_names["in"]) == ends, 30,
                 what="committed offsets to reach the end offsets")
        assert w.stop() == 0, w.log()[-3000:]
    finally:
        w.kill()

    values = decode(results)
    ids = [v["id"] for v in values]
    assert len(ids) == n, f"expected exactly {n} results, got {len(ids)}"
    assert set(ids) == {f"r-{i}" for i in range(n)}
    assert all(v["status"] == "ok" and len(v["outputs"]) == 4 for v in values)
    # the result key is the request key
    assert all(m.key() == v["id"].encode() for m, v in zip(results, values, strict=True))

    dlq = read_all(bs, topic_names["dlq"], want=1, timeout=30)
    assert len(dlq) == 1
    h = dict(dlq[0].headers())
    assert dlq[0].value() == b'{"id": "broken", "inputs": [1, 2'  # original bytes
    assert dlq[0].key() == b"broken"
    assert h["x-error-stage"] == b"decode" and h["x-source-partition"] == b"2"
    assert h["x-source-topic"] == topic_names["in"].encode() and h["x-error"].startswith(b"undecodable json")

    # Restart: everything is committed, so nothing old is processed again. One new request per partition
    # shows that the restarted worker read every partition from where it was committed: once their results
    # are out, it has consumed past anything it could have re-read, and a graceful stop delivers all of it.
    w2 = WorkerProcess(cfg, tmp_path, name="restart").start()
    try:
        w2.wait_assigned()
        for part in range(4):
            produce_values(bs, topic_names["in"], [request(part, prefix="after-restart")], partition=part)
        read_all(bs, topic_names["out"], want=n + 4, timeout=60)
        assert w2.stop() == 0
    finally:
        w2.kill()
    again = [v["id"] for v in decode(read_all(bs, topic_names["out"], timeout=30, idle=2))]
    assert len(again) == n + 4, f"restart reprocessed {len(again) - n - 4} records"
    assert set(again) == set(ids) | {f"after-restart-{p}" for p in range(4)}
    print(f"[e2e] results={len(ids)} dlq={len(dlq)} committed==end for {len(ends)} "
          "partitions; restart added 0")


def test_input_from_a_transactional_producer_is_committed_to_its_end(kafka, topic_names, tmp_path):
    """Each committed transaction leaves a marker after its records, an offset no consume returns. The worker
    commits the consumer's position past it once everything before it is done: committing "last record + 1"
    left a lag of 1 per partition for good (KEDA never scaled to zero; the HPA read an idle replica as
    busy)."""
    from confluent_kafka import Producer

    bs = kafka.bootstrap
    create_topics(bs, {topic_names["in"]: 2, topic_names["out"]: 2, topic_names["dlq"]: 1})
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
    cfg = worker_config(bs, topic_names)
    w = WorkerProcess(cfg, tmp_path).start()
    try:
        assert len(read_all(bs, topic_names["out"], want=20, timeout=120)) == 20
        wait_for(lambda: committed_offsets(bs, cfg["kafka"]["group_id"], topic_names["in"]) == ends, 30,
                 what="committed offsets to pass the last transaction marker")
        assert w.stop() == 0, w.log()[-3000:]
    finally:
        w.kill()
