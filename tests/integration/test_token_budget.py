"""Token budgets on the real broker: a backlog of records of mixed sizes runs in batches within the lane's
``max_batch_tokens``; a record over the budget runs alone; one over the model's ``max_size`` goes to the
dead-letter topic (stage ``size``); every record gets one result."""

from __future__ import annotations

import random

import msgspec
import pytest

from tests.support.kafka_io import decode

pytestmark = pytest.mark.integration


def test_batches_stay_within_the_token_budget(scenario):
    n = 400
    scenario.topics(1)
    rnd = random.Random(3)
    sizes = [rnd.choice([1, 2, 5, 10, 30]) for _ in range(n)]
    # over the budget (alone), over max_size (refused), alone
    sizes[50], sizes[120], sizes[300] = 120, 200, 120
    enc = msgspec.json.encode
    scenario.produce([(f"r-{i}".encode(), enc({"id": f"r-{i}", "inputs": {"n": s}}))
                      for i, s in enumerate(sizes)])
    cfg = scenario.config(model={"name": "tests.support.sized_model:make"},
                          batching={"lanes": [{"name": "default", "max_batch_size": 64, "max_wait_ms": 200,
                                               "max_batch_tokens": 100}]})
    with scenario.worker(cfg):
        results = decode(scenario.read_out(want=n, timeout=180))
        dead = scenario.read_dlq(want=1, timeout=60)
    by_id = {r["id"]: r for r in results}
    assert len(by_id) == n, "a record got no result, or two"
    refused = by_id["r-120"]
    assert refused["status"] == "error" and "max_size=150" in refused["error"]
    assert [m.value() for m in dead] and dict(dead[0].headers())["x-error-stage"] == b"size"
    ok = [r for r in results if r["status"] == "ok"]
    assert len(ok) == n - 1
    for r in ok:
        cost, size = r["outputs"]["batch_cost"], r["outputs"]["n"]
        assert cost <= 100 or (r["batch_size"] == 1 and cost == size), f"{r['id']}: a batch cost {cost}"
    assert by_id["r-50"]["batch_size"] == 1 and by_id["r-300"]["batch_size"] == 1
    assert max(r["batch_size"] for r in ok) > 10, "short records ran in batches of many"
