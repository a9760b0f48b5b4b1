"""kill -9 of the worker at 5 seeded progress points of a 30,000-record run, restarted each time.

at-least-once: every id gets >= 1 result, and every duplicate is one a kill explains
(tests/chaos/kill_windows.py): each result is placed in the worker process that produced it by its message
timestamp, a process produces each record once, and a process started after a kill produces again only
records at or past the commit read right after that kill. The duplicates are then at most what the kills
left between that commit and the end of what the killed processes produced. ``max_in_flight`` is 1,000 so
that in-flight work is a small part of the run. exactly-once: every id exactly once for a read_committed
reader.
"""

from __future__ import annotations

import time

import pytest

from tests.chaos.kill_windows import copies, unexplained, windows
from tests.chaos.support import (
    Incident,
    OutputWatcher,
    kill_points,
    report,
    supervise,
    tally,
    wait_committed_to_end,
    where_things_stand,
)
from tests.support.kafka_io import (
    WorkerProcess,
    committed_offsets,
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
                        batching={"max_in_flight": 1000},
                        delivery={"mode": mode, "transactional_id": f"chaos-{topic_names['run']}"})
    group = cfg["kafka"]["group_id"]
    points = kill_points(N, 5, SEED + (mode == "exactly_once"))
    kill_times: list[float] = []  # wall clock: which process produced a result (its timestamp)
    committed_at: list[dict[int, int]] = []  # per kill: the group's commits the next process starts from

    with OutputWatcher(bs, topic_names["out"], read_committed=True) as watch:
        watch.wait_assigned()

        def after_kill(_i: Incident) -> None:
            kill_times.append(time.time())  # the killed process is gone (kill() waited for it)
            # A commit the killed process had sent reaches the broker within milliseconds; the next worker
            # cannot commit before the killed member is evicted (session.timeout.ms, 6 s). It starts after
            # this second, so every result stamped before the kill is the killed process's (or an earlier's).
            time.sleep(1.0)
            # Not stable: the killed process may have left a transaction holding offsets (exactly-once), which
            # only the next worker's start aborts; a stable read waited for it (and timed out, once in CI).
            committed_at.append(committed_offsets(bs, group, topic_names["in"], stable=False))

        sup = supervise(lambda i: WorkerProcess(cfg, tmp_path, name=f"{mode}-{i}"),
                        lambda: watch.seen(expected), N, kill_at=points, deadline_s=170, restart_exits=False,
                        on_kill=after_kill, diagnose=lambda: where_things_stand(
                            bs, cfg["kafka"]["group_id"], topic_names["in"], topic_names["out"], watch))
    last = sup.current
    try:
        assert len(sup.kills) == 5, [(i.kind, i.progress) for i in sup.incidents]
        wait_committed_to_end(bs, group, topic_names["in"], 30)
        assert last.stop() == 0, last.log()[-3000:]
    finally:
        last.kill()

    t = tally(bs, topic_names["out"], topic_names["dlq"], expected, N, read_committed=True)
    by_copy = copies(t.by_id, t.stamps, kill_times)
    left = windows(by_copy, committed_at)  # per kill: partition -> [committed, end of what was produced)
    room = sum(max(0, v - c) for w in left for c, v in w.values())  # duplicates the kills can explain
    report(f"kill9-{mode}", t, kills=len(sup.kills), at=",".join(str(i.progress) for i in sup.kills),
           seconds=round(sup.elapsed_s), dup_room=room)
    assert t.lost == 0, f"{t.lost} ids without a result"
    assert t.dlq == 0
    assert all(v["status"] == "ok" for vs in t.by_id.values() for v in vs)
    assert set(t.by_id) == expected, f"unexpected ids: {sorted(set(t.by_id) - expected)[:5]}"
    dup_ids = sorted(i for i, vs in t.by_id.items() if len(vs) > 1)
    if mode == "exactly_once":
        assert t.duplicates == 0, f"{t.duplicates} duplicate results under read_committed, e.g. {dup_ids[:5]}"
        return
    assert len(committed_at) == 5
    bad = unexplained(by_copy, committed_at)
    moved = [f"{w.name}: {line}" for w in sup.workers
             for line in w.log().splitlines() if "moved back" in line]
    assert not bad, (f"{len(bad)} ids with results the kills do not explain, e.g. {bad[:5]}; copies "
                     f"{[(rid, by_copy[rid]) for rid, _ in bad[:2]]}; kills left {left}; {moved[:4]}")
    assert t.duplicates <= room, f"{t.duplicates} duplicates, the kills left room for {room}: {left}"
