"""A fresh group whose partitions only partly have a commit, read under backpressure from the first poll:
each record gets one result.

The partitions with a commit fill ``max_in_flight`` at once, while those without one are still looking up
where to start (``auto.offset.reset``). Pausing and resuming a partition during that lookup made librdkafka
deliver its first records again after the worker processed them (design notes: "A partition's first
records read twice"); in 25 such starts of a consumer alone, 9 re-delivered a partition from offset 0.
Several fresh groups run one after the other, so that the race, if it is back, is all but sure to show.
"""

from __future__ import annotations

import uuid
from collections import Counter

import msgspec
import pytest
from confluent_kafka import Consumer
from confluent_kafka import TopicPartition as KTP

from tests.chaos.support import report, tally, wait_committed_to_end
from tests.support.kafka_io import WorkerProcess, create_topics, produce_values, request, worker_config

pytestmark = pytest.mark.chaos

PARTITIONS, PER_PARTITION, COMMITTED_AT = 8, 1500, 100
WITH_COMMIT = range(4)  # partitions 0-3 start at COMMITTED_AT, 4-7 from the beginning
GROUPS = 6
_dec = msgspec.json.Decoder()


def test_partitions_without_a_commit_are_read_once_under_backpressure(kafka, topic_names, tmp_path):
    bs = kafka.bootstrap
    topic = topic_names["in"]
    create_topics(bs, {topic: PARTITIONS})
    for p in range(PARTITIONS):
        produce_values(bs, topic, [request(i, prefix=f"p{p}") for i in range(PER_PARTITION)], partition=p)
    want = PARTITIONS * PER_PARTITION - len(WITH_COMMIT) * COMMITTED_AT
    moved: list[str] = []
    extra: Counter[str] = Counter()
    for g in range(GROUPS):
        names = {**topic_names, "out": f"{topic_names['out']}-{g}", "dlq": f"{topic_names['dlq']}-{g}"}
        create_topics(bs, {names["out"]: 4, names["dlq"]: 1})
        group = f"first-{uuid.uuid4().hex[:8]}"
        pre = Consumer({"bootstrap.servers": bs, "group.id": group})
        pre.commit(offsets=[KTP(topic, p, COMMITTED_AT) for p in WITH_COMMIT], asynchronous=False)
        pre.close()
        cfg = worker_config(bs, names, group=group, model={"name": "identity"},
                            batching={"max_in_flight": 1000})
        w = WorkerProcess(cfg, tmp_path, name=f"first-{g}").start()
        try:
            wait_committed_to_end(bs, group, topic, 120)
            assert w.stop() == 0, w.log()[-3000:]
        finally:
            w.kill()
        moved += [f"{w.name}: {line}" for line in w.log().splitlines() if "moved back" in line]
        expected = {f"p{p}-{i}" for p in range(PARTITIONS)
                    for i in range(COMMITTED_AT if p in WITH_COMMIT else 0, PER_PARTITION)}
        t = tally(bs, names["out"], names["dlq"], expected, want, idle=2.0)
        report(f"first-records-{g}", t)
        assert t.lost == 0 and t.dlq == 0, f"group {g}: {t.lost} lost, {t.dlq} dead letters"
        extra[f"group {g}"] = t.duplicates
    assert not moved and sum(extra.values()) == 0, f"second results: {dict(extra)}; {moved[:4]}"
