"""kill -9 of the worker at 5 seeded progress points of a 30,000-record run, restarted each time.

at-least-once: every id gets >= 1 result (duplicates allowed: what was in flight at each kill).
exactly-once: every id exactly once for a read_committed reader.
"""

from __future__ import annotations

import pytest

from tests.chaos.support import OutputWatcher, kill_points, report, supervise, tally, wait_committed_to_end
from tests.support.kafka_io import (
    WorkerProcess,
    create_topics,
    produce_values,
    request,
    worker_config,
)

pytestmark = pytest.mark.chaos

N = 30_000
SEED = 20240605
FAST_GROUP = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}  # a killed member is evicted in ~6 s


@pytest.mark.parametrize("mode", ["at_least_once", "exactly_once"])
def test_kill9_five_times(kafka, topic_names, tmp_path, mode):
    bs = kafka.bootstrap
    create_topics(bs, {topic_names["in"]: 4, topic_names["out"]: 4, topic_names["dlq"]: 1})
    reqs = [request(i) for i in range(N)]
    produce_values(bs, topic_names["in"], reqs)
    expected = {k.decode() for k, _ in reqs}
    cfg = worker_config(bs, topic_names, model={"name": "identity"},
                        kafka={"consumer": FAST_GROUP, "commit_interval_ms": 300},
                        delivery={"mode": mode, "transactional_id": f"chaos-{topic_names['run']}"})
    group = cfg["kafka"]["group_id"]
    points = kill_points(N, 5, SEED + (mode == "exactly_once"))

    with OutputWatcher(bs, topic_names["out"], read_committed=True) as watch:
        sup = supervise(lambda i: WorkerProcess(cfg, tmp_path, name=f"{mode}-{i}"),
                        lambda: watch.seen(expected), N, kill_at=points, deadline_s=170, restart_exits=False)
    last = sup.current
    try:
        assert len(sup.kills) == 5, [(i.kind, i.progress) for i in sup.incidents]
        wait_committed_to_end(bs, group, topic_names["in"], 30)
        assert last.stop() == 0, last.log()[-3000:]
    finally:
        last.kill()

    t = tally(bs, topic_names["out"], topic_names["dlq"], expected, N, read_committed=True)
    report(f"kill9-{mode}", t, kills=len(sup.kills), at=",".join(str(i.progress) for i in sup.kills),
           seconds=round(sup.elapsed_s))
    assert t.lost == 0, f"{t.lost} ids without a result"
    assert t.dlq == 0
    assert all(v["status"] == "ok" for vs in t.by_id.values() for v in vs)
    assert set(t.by_id) == expected, f"unexpected ids: {sorted(set(t.by_id) - expected)[:5]}"
    if mode == "exactly_once":
        dup_ids = sorted(i for i, vs in t.by_id.items() if len(vs) > 1)
        assert t.duplicates == 0, f"{t.duplicates} duplicate results under read_committed, e.g. {dup_ids[:5]}"
