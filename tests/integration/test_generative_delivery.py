"""Exactly-once with a generative model: sequences finish out of order, results are produced in offset order
inside the transactions, each id is visible once to a read_committed reader."""

from __future__ import annotations

import collections

import msgspec
import pytest

from tests.support.kafka_io import (
    WorkerProcess,
    committed_offsets,
    create_topics,
    decode,
    end_offsets,
    produce_values,
    read_all,
    wait_for,
    worker_config,
)

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("admission", ["reserve", "grow"])
@pytest.mark.parametrize("model", ["synthetic-lm"])
def test_generative_exactly_once_in_offset_order(kafka, topic_names, tmp_path, model, admission):
    bs, n = kafka.bootstrap, 600
    create_topics(bs, {topic_names["in"]: 2, topic_names["out"]: 2, topic_names["dlq"]: 1})
    # Long then short: the later records finish first.
    items = [(f"e-{i}".encode(), msgspec.json.encode(
        {"id": f"e-{i}", "inputs": {"prompt": f"p{i}", "max_new_tokens": 40 if i % 4 == 0 else 2}}))
        for i in range(n)]
    produce_values(bs, topic_names["in"], items)
    # A small token budget: under grow admission sequences outgrow it and are preempted and recomputed.
    cfg = worker_config(bs, topic_names, model={"name": model, "options": {"a_ms": 1.0, "b_ms": 0.01},
                                                "generation": {"admission": admission,
                                                               "max_batch_tokens": 600}},
                        delivery={"mode": "exactly_once", "transactional_id": f"tx-{topic_names['run']}"})
    w = WorkerProcess(cfg, tmp_path).start()
    try:
        results = read_all(bs, topic_names["out"], want=n, timeout=120)
        ends = end_offsets(bs, topic_names["in"])
        wait_for(lambda: committed_offsets(bs, cfg["kafka"]["group_id"], topic_names["in"]) == ends, 30,
                 what="offsets committed through the transaction")
        assert w.stop() == 0, w.log()[-3000:]
    finally:
        w.kill()
    values = decode(results)
    ids = collections.Counter(r["id"] for r in values)
    assert set(ids) == {f"e-{i}" for i in range(n)} and max(ids.values()) == 1
    last: dict[tuple[int, int], int] = {}
    for m, r in zip(results, values, strict=True):
        k = (m.partition(), r["source"]["partition"])
        assert r["source"]["offset"] > last.get(k, -1), f"out of order in output partition {k[0]}"
        last[k] = r["source"]["offset"]
        assert r["outputs"]["generated_tokens"] in (2, 40)
