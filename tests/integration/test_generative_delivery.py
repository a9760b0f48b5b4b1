"""Exactly-once with a generative model: sequences finish out of order, results are produced in offset order
inside the transactions, each id is visible once to a read_committed reader."""

from __future__ import annotations

import msgspec
import pytest

from tests.support.kafka_io import once_each_in_source_order

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("admission", ["reserve", "grow"])
@pytest.mark.parametrize("model", ["synthetic-lm"])
def test_generative_exactly_once_in_offset_order(scenario, topic_names, model, admission):
    n = 600
    scenario.topics(2)
    # Long then short: the later records finish first.
    items = [(f"e-{i}".encode(), msgspec.json.encode(
        {"id": f"e-{i}", "inputs": {"prompt": f"p{i}", "max_new_tokens": 40 if i % 4 == 0 else 2}}))
        for i in range(n)]
    scenario.produce(items)
    # A small token budget: under grow admission sequences outgrow it and are preempted and recomputed.
    cfg = scenario.config(model={"name": model, "options": {"a_ms": 1.0, "b_ms": 0.01},
                                 "generation": {"admission": admission, "max_batch_tokens": 600}},
                          delivery={"mode": "exactly_once", "transactional_id": f"tx-{topic_names['run']}"})
    results, _ = scenario.serve(cfg, want=n, timeout=120)
    values = once_each_in_source_order(results, {f"e-{i}" for i in range(n)})
    assert all(r["outputs"]["generated_tokens"] in (2, 40) for r in values)
