"""The delivered-id ledger on a real Redis and a real broker: a record read again (here by a second consumer
group over the same input, as after a lost commit) whose id already got an ok result is acknowledged without
running the model or writing a second result; a request whose result was an error is processed again."""

from __future__ import annotations

import uuid

import pytest

from tests.support.kafka_io import decode, request

pytestmark = pytest.mark.integration


def test_ledger_skips_ids_already_delivered_ok_and_reprocesses_failed_ones(scenario, local_redis,
                                                                           topic_names):
    n = 400
    scenario.topics(2)
    scenario.produce([request(i) for i in range(n)])
    # error result
    scenario.produce([(b"bad", b'{"id": "bad", "inputs": "not a list"}')])
    redis = {"url": local_redis.url, "ledger": True, "key_prefix": f"kiw-ledger:{uuid.uuid4().hex[:8]}:"}

    def run(group: str, want: int) -> list[dict]:
        """A worker in ``group`` until it has committed the whole input; then every result on the topic."""
        cfg = scenario.config(group, redis=redis)
        scenario.serve(cfg, want=want, timeout=120, commit_timeout=60, name=group)
        # After a graceful stop every result it wrote is on the topic: read them all, not just ``want``.
        return decode(scenario.read_out(timeout=30, idle=2))

    first = run(f"first-{topic_names['run']}", n + 1)
    assert [r["status"] for r in first].count("ok") == n and [r["id"] for r in first].count("bad") == 1
    # The same n + 1 records again: every ok id is in the ledger, so only "bad" gets a (second) result.
    ids = [r["id"] for r in run(f"second-{topic_names['run']}", n + 2)]
    assert len(ids) == n + 2 and ids.count("bad") == 2, (f"{len(ids) - n - 1} new results, "
                                                         "expected 1 (for 'bad')")
