"""kill -9 with ``model.processes: 2``: of a child (the supervisor restarts it) and of the supervisor (its
children get SIGTERM and drain; a new supervisor takes over), alternately, at 4 seeded progress points of a
20,000-record run fed at about 1,000 records/s. Every id gets a result (at-least-once), exactly one
(exactly-once, read_committed)."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import pytest

from tests.chaos.support import (
    OutputWatcher,
    kill_points,
    report,
    tally,
    wait_committed_to_end,
    where_things_stand,
)
from tests.support.kafka_io import (
    WorkerProcess,
    create_topics,
    produce_values,
    request,
    wait_for,
    worker_config,
)

pytestmark = pytest.mark.chaos

N = 20_000
SEED = 20261202
FAST_GROUP = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}
STARTED = re.compile(r"child (\d) started \(pid (\d+)\)")


def live_child(w: WorkerProcess, index: int) -> int:
    """The pid of child ``index`` of supervisor ``w`` (the last one its log names), once it runs."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        pids = [int(p) for i, p in STARTED.findall(w.log()) if int(i) == index]
        if pids:
            try:
                os.kill(pids[-1], 0)
                return pids[-1]
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    raise AssertionError(f"{w.name}: no live child {index} in the log:\n{w.log()[-3000:]}")


@pytest.mark.parametrize("mode", ["at_least_once", "exactly_once"])
def test_kill9_of_a_child_and_of_the_supervisor_loses_nothing(kafka, topic_names, tmp_path, mode):
    bs = kafka.bootstrap
    create_topics(bs, {topic_names["in"]: 4, topic_names["out"]: 4, topic_names["dlq"]: 1})
    reqs = [request(i) for i in range(N)]
    # Produced at about 1,000/s while the workers run: progress follows the input, so each kill lands at its
    # point (with everything produced up front, two processes ran past the last points during a restart).
    feeder = threading.Thread(target=lambda: [
        (produce_values(bs, topic_names["in"], reqs[i:i + 500]), time.sleep(0.5)) for i in range(0, N, 500)],
        name="feeder", daemon=True)
    expected = {k.decode() for k, _ in reqs}
    cfg = worker_config(bs, topic_names, model={"name": "identity", "processes": 2},
                        kafka={"consumer": FAST_GROUP, "commit_interval_ms": 300},
                        batching={"max_in_flight": 1000},
                        delivery={"mode": mode, "transactional_id": f"chaos-{topic_names['run']}"})
    group = cfg["kafka"]["group_id"]
    pending = kill_points(N, 4, SEED + (mode == "exactly_once"), min_gap=0.12)
    kinds = ["child", "supervisor", "child", "supervisor"]
    done_kills: list[tuple[str, int]] = []
    sups = [WorkerProcess(cfg, tmp_path, name=f"{mode}-sup-0").start()]
    t0 = time.monotonic()
    feeder.start()
    with OutputWatcher(bs, topic_names["out"], read_committed=True) as watch:
        try:
            while (seen := watch.seen(expected)) < N:
                sup = sups[-1]
                assert sup.proc is not None
                rc = sup.proc.poll()
                assert rc is None, f"supervisor {sup.name} exited {rc} at {seen}/{N}:\n{sup.log()[-4000:]}"
                if pending and seen >= pending[0]:
                    pending.pop(0)
                    kind = kinds[len(done_kills)]
                    if kind == "child":
                        before = sup.log().count("restarting it in")
                        os.kill(live_child(sup, len(done_kills) % 2), signal.SIGKILL)
                        # Before the next kill can come (progress jumps when a transaction commits), the
                        # supervisor has seen this one.
                        wait_for(lambda s=sup, b=before: s.log().count("restarting it in") > b, 30,
                                 what=f"{sup.name} to restart the killed child")
                    else:
                        sup.kill()  # SIGKILL: its children get SIGTERM (PR_SET_PDEATHSIG) and drain
                        sups.append(WorkerProcess(cfg, tmp_path, name=f"{mode}-sup-{len(sups)}").start())
                    done_kills.append((kind, seen))
                assert time.monotonic() - t0 < 300, (
                    f"progress {seen}/{N} after kills {done_kills}; "
                    f"{where_things_stand(bs, group, topic_names['in'], topic_names['out'], watch)}\n"
                    + "\n".join(f"--- {s.name} ---\n{s.log()[-2500:]}" for s in sups))
                time.sleep(0.05)
            last = sups[-1]
            assert len(done_kills) == 4, done_kills
            wait_committed_to_end(bs, group, topic_names["in"], 60)
            assert last.stop(90) == 0, last.log()[-4000:]
        finally:
            for s in sups:
                s.kill()
    restarted = sum(s.log().count("restarting it in") for s in sups)
    assert restarted >= 2, "the supervisor did not restart the killed children"
    t = tally(bs, topic_names["out"], topic_names["dlq"], expected, N, read_committed=True)
    report(f"kill9-processes-{mode}", t, kills=",".join(f"{k}@{p}" for k, p in done_kills),
           seconds=round(time.monotonic() - t0), restarts=restarted)
    assert t.lost == 0, f"{t.lost} ids without a result"
    assert t.dlq == 0
    assert set(t.by_id) == expected
    assert all(v["status"] == "ok" for vs in t.by_id.values() for v in vs)
    if mode == "exactly_once":
        assert t.duplicates == 0, f"{t.duplicates} duplicate results under read_committed"
