"""Priority lanes on the real broker: both lanes backlogged -> the high lane first, the low lane still
gets at least its configured share."""

from __future__ import annotations

import msgspec
import pytest

from tests.support.kafka_io import create_topics, decode, produce_values

pytestmark = pytest.mark.integration


def test_high_lane_first_low_lane_keeps_its_share(scenario, topic_names):
    bs, n = scenario.bootstrap, 1500
    hi, lo = topic_names["in"] + "-hi", topic_names["in"] + "-lo"
    create_topics(bs, {hi: 2, lo: 2, topic_names["out"]: 1, topic_names["dlq"]: 1})
    enc = msgspec.json.encode
    produce_values(bs, lo, [(f"lo-{i}".encode(), enc({"id": f"lo-{i}",
                                                      "inputs": {"x": i}})) for i in range(n)])
    produce_values(bs, hi, [(f"hi-{i}".encode(), enc({"id": f"hi-{i}",
                                                      "inputs": {"x": i}})) for i in range(n)])
    cfg = scenario.config(kafka={"input_topics": []},
                          model={"name": "synthetic", "options": {"a_ms": 4, "b_ms": 0.2}},
                          # The low lane is listed first: priority, not the config order, must put high first.
                          batching={"lanes": [
                              {"name": "low", "topics": [lo], "priority": 0, "weight": 1,
                               "max_batch_size": 16, "max_wait_ms": 5},
                              {"name": "high", "topics": [hi], "priority": 10, "weight": 3,
                               "max_batch_size": 16, "max_wait_ms": 5}],
                              "default_lane": "low"})
    with scenario.worker(cfg):
        results = decode(scenario.read_out(want=2 * n, timeout=240))
    lanes = [r["lane"] for r in results]
    assert len({r["id"] for r in results}) == 2 * n
    assert all(r["lane"] == r["id"].split("-")[0].replace("hi", "high").replace("lo", "low") for r in results)
    # While both lanes are backlogged (until the high lane drains), count who got served.
    last_high = max(i for i, lane in enumerate(lanes) if lane == "high")
    window = lanes[: last_high + 1]
    low_share = window.count("low") / len(window)
    first_high = lanes.index("high")
    mean_pos = {k: sum(i for i, x in enumerate(lanes) if x == k) / n for k in ("high", "low")}
    print(f"\n[lanes] window={len(window)} low share={low_share:.3f} (configured minimum 0.25) "
          f"first high at {first_high}, mean position high={mean_pos['high']:.0f} low={mean_pos['low']:.0f}")
    assert mean_pos["high"] < mean_pos["low"], "the high lane was not served first"
    assert low_share >= 0.25 * 0.8, f"low lane starved: {low_share:.3f} of served records while backlogged"
    assert low_share <= 0.5, f"priority not applied: low lane got {low_share:.3f}"
