"""A second worker joins while the first has sequences in flight: the first abandons the sequences of the
partitions it gives up (its revoke does not wait for them), every id gets a result, offsets reach the end."""

from __future__ import annotations

import datetime as dt
import json

import msgspec
import pytest

from tests.support.kafka_io import WorkerProcess, decode, wait_for

pytestmark = pytest.mark.integration


def test_revoke_abandons_in_flight_sequences(scenario, tmp_path):
    n = 200
    scenario.topics(4)
    items = [(f"s-{i}".encode(), msgspec.json.encode(
        {"id": f"s-{i}", "inputs": {"prompt": f"p{i}", "max_new_tokens": 200 + (i % 5) * 300}}))
        for i in range(n)]
    scenario.produce(items)
    # Every request runs at once (200 sequences, steps of >= 4 ms): the first finish after 200 steps, the
    # longest take 1,400, so when the second worker joins, sequences of every partition are running.
    cfg = scenario.config(model={"name": "synthetic-lm", "options": {"a_ms": 4.0, "b_ms": 0.05},
                                 "generation": {"max_sequences": 256, "max_new_tokens": 2000,
                                                "max_batch_tokens": 1_000_000}},
                          delivery={"revoke_timeout_ms": 20000})
    group = cfg["kafka"]["group_id"]
    a = WorkerProcess(cfg, tmp_path, name="gen-a").start()
    b = WorkerProcess(cfg, tmp_path, name="gen-b")
    try:
        a.wait_assigned()
        wait_for(lambda: len(scenario.read_out(timeout=5, idle=0.5)) >= 1, 60, what="the first results")
        b.start()
        b.wait_assigned()
        # (the long timeout is for a machine whose CPUs are busy elsewhere)
        scenario.delivered(group, want=n, timeout=600, commit_timeout=120)
        assert a.stop() == 0, a.log()[-3000:]
        assert b.stop() == 0, b.log()[-3000:]
    finally:
        a.kill()
        b.kill()
    # The sequences of the partitions the second worker took ran again there, and those the first had
    # finished past the committed offset come twice: the first n results on the topic may lack ids. After
    # both stopped gracefully with the input committed to its end, every result is on the topic.
    ids = {v["id"] for v in decode(scenario.read_out(timeout=30, idle=2))}
    assert ids == {f"s-{i}" for i in range(n)}
    lines = [json.loads(line) for line in a.log().splitlines() if line.startswith("{")]
    abandoned = [x for x in lines if "abandoned" in x["msg"]]
    released = [x for x in lines if x["msg"] == "partitions released"]
    assert abandoned and released, a.log()[-3000:]
    assert abandoned[0]["sequences"] > 0

    def ts(x: dict) -> float:
        return dt.datetime.fromisoformat(x["ts"].replace("Z", "+00:00")).timestamp()

    # The revoke dropped the in-flight sequences instead of waiting (up to revoke_timeout_ms, 20 s) for them
    # to finish, which takes over a second.
    took = ts(released[0]) - ts(abandoned[0])
    assert 0 <= took < 1.0, f"the revoke took {took:.2f} s after abandoning"
