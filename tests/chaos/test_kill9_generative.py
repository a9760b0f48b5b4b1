"""kill -9 of a worker running a generative model (synthetic-lm), 3 times in a 4,000-request run.

Sequences of 1-24 new tokens finish out of order inside one continuous batch; each finished one advances
its partition's commit through the offset tracker. at-least-once: every id gets >= 1 result; exactly-once:
every id exactly once for a read_committed reader.
"""

from __future__ import annotations

import time

import msgspec
import pytest

from tests.chaos.support import OutputWatcher, kill_points, report, supervise, tally, wait_committed_to_end
from tests.support.kafka_io import WorkerProcess, create_topics, produce_values, worker_config

pytestmark = pytest.mark.chaos

N = 4000
SEED = 20261202
FAST_GROUP = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}


def gen(i: int) -> tuple[bytes, bytes]:
    rid = f"g-{i}"
    body = {"id": rid, "inputs": {"prompt": f"event {i}", "max_new_tokens": 1 + (i * 7) % 24}}
    return rid.encode(), msgspec.json.encode(body)


@pytest.mark.parametrize("mode", ["at_least_once", "exactly_once"])
def test_kill9_generative(kafka, topic_names, tmp_path, mode):
    bs = kafka.bootstrap
    create_topics(bs, {topic_names["in"]: 4, topic_names["out"]: 4, topic_names["dlq"]: 1})
    reqs = [gen(i) for i in range(N)]
    produce_values(bs, topic_names["in"], reqs)
    expected = {k.decode() for k, _ in reqs}
    cfg = worker_config(bs, topic_names,
                        model={"name": "synthetic-lm", "options": {"a_ms": 2.0, "b_ms": 0.01},
                               "generation": {"max_sequences": 64, "max_batch_tokens": 4096}},
                        kafka={"consumer": FAST_GROUP, "commit_interval_ms": 300},
                        batching={"max_in_flight": 500},
                        delivery={"mode": mode, "transactional_id": f"chaos-gen-{topic_names['run']}"})
    group = cfg["kafka"]["group_id"]
    with OutputWatcher(bs, topic_names["out"], read_committed=True) as watch:
        sup = supervise(lambda i: WorkerProcess(cfg, tmp_path, name=f"gen-{mode}-{i}"),
                        lambda: watch.seen(expected), N, kill_at=kill_points(N, 3, SEED), deadline_s=170,
                        restart_exits=False, on_kill=lambda _i: time.sleep(1.0))
    last = sup.current
    try:
        assert len(sup.kills) == 3, [(i.kind, i.progress) for i in sup.incidents]
        wait_committed_to_end(bs, group, topic_names["in"], 30)
        assert last.stop() == 0, last.log()[-3000:]
    finally:
        last.kill()
    t = tally(bs, topic_names["out"], topic_names["dlq"], expected, N, read_committed=True)
    report(f"kill9-generative-{mode}", t, kills=len(sup.kills), seconds=round(sup.elapsed_s))
    assert t.lost == 0, f"{t.lost} ids without a result"
    assert t.dlq == 0
    assert set(t.by_id) == expected
    assert all(v["status"] == "ok" and v["outputs"]["finish_reason"] == "length"
               for vs in t.by_id.values() for v in vs)
    if mode == "exactly_once":
        assert t.duplicates == 0, f"{t.duplicates} duplicate results under read_committed"
