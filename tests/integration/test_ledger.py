"""The delivered-id ledger on a real Redis and a real broker: a record read again (here by a second consumer
group over the same input, as after a lost commit) whose id already got an ok result is acknowledged without
running the model or writing a second result; a request whose result was an error is processed again."""

from __future__ import annotations

import uuid

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


def test_ledger_skips_ids_already_delivered_ok_and_reprocesses_failed_ones(kafka, local_redis, topic_names,
                                                                           tmp_path):
    bs, n = kafka.bootstrap, 400
    create_topics(bs, {topic_names["in"]: 2, topic_names["out"]: 2, topic_names["dlq"]: 1})
    produce_values(bs, topic_names["in"], [request(i) for i in range(n)])
    # error result
    produce_values(bs, topic_names["in"], [(b"bad", b'{"id": "bad", "inputs": "not a list"}')])
    redis = {"url": local_redis.url, "ledger": True, "key_prefix": f"kiw-ledger:{uuid.uuid4().hex[:8]}:"}

    def run(group: str, want: int) -> list[dict]:
        """A worker in ``group`` until it has committed the whole input; then every result on the topic."""
        cfg = worker_config(bs, topic_names, group=group, redis=redis)
        w = WorkerProcess(cfg, tmp_path, name=group).start()
        try:
            read_all(bs, topic_names["out"], want=want, timeout=120)
            ends = end_offsets(bs, topic_names["in"])
            wait_for(lambda: committed_offsets(bs, group, topic_names["in"]) == ends, 60,
                     what=f"{group}'s commits to reach the end offsets")
            assert w.stop() == 0, w.log()[-3000:]
        finally:
            w.kill()
        # After a graceful stop every result it wrote is on the topic: read them all, not just ``want``.
        return decode(read_all(bs, topic_names["out"], timeout=30, idle=2))

    first = run(f"first-{topic_names['run']}", n + 1)
    assert [r["status"] for r in first].count("ok") == n and [r["id"] for r in first].count("bad") == 1
    # The same n + 1 records again: every ok id is in the ledger, so only "bad" gets a (second) result.
    ids = [r["id"] for r in run(f"second-{topic_names['run']}", n + 2)]
    assert len(ids) == n + 2 and ids.count("bad") == 2, (f"{len(ids) - n - 1} new results, "
                                                         "expected 1 (for 'bad')")
