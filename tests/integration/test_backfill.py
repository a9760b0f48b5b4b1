"""``worker backfill``: exactly the snapshot, exit 0; killed or stopped halfway and rerun -> every id has a
result; --from-timestamp; an input written by a transactional producer."""

from __future__ import annotations

import collections
import signal
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from confluent_kafka import Producer

from tests.support.kafka_io import (
    WorkerProcess,
    committed_offsets,
    create_topics,
    decode,
    end_offsets,
    member_with_partitions,
    read_all,
    worker_config,
)
from worker.app.load import produce, requests

pytestmark = pytest.mark.integration


def test_backfill_20000_exactly_then_exit_0(kafka, topic_names, tmp_path):
    bs, n = kafka.bootstrap, 20_000
    create_topics(bs, {topic_names["in"]: 4, topic_names["out"]: 4, topic_names["dlq"]: 1})
    produce(bs, topic_names["in"], requests(n, "identity", id_prefix="bf"))
    cfg = worker_config(bs, topic_names, model={"name": "identity"},
                        batching={"lanes": [{"name": "default", "max_batch_size": 512, "max_wait_ms": 5}]})
    w = WorkerProcess(cfg, tmp_path, command="backfill").start()
    rc = w.wait(300)
    assert rc == 0, w.log()[-3000:]
    assert "backfill summary" in w.log() and f"{n} records read" in w.log()
    results = decode(read_all(bs, topic_names["out"], want=n, timeout=60))
    ids = collections.Counter(r["id"] for r in results)
    print(
        f"\n[backfill] {len(results)} results for {n} records; last lines:\n"
        + "\n".join(w.log().splitlines()[-2:])
    )
    assert len(results) == n and set(ids) == {f"bf-{i}" for i in range(n)}

    # Records produced after the snapshot are left alone; a second backfill picks up only those.
    produce(bs, topic_names["in"], requests(10, "identity", id_prefix="late"))
    w2 = WorkerProcess(cfg, tmp_path, command="backfill", name="again").start()
    assert w2.wait(120) == 0, w2.log()[-3000:]
    assert "10 records read" in w2.log()


def _slow_backfill_under_way(kafka: Any, topic_names: dict[str, str], tmp_path: Path, n: int, prefix: str,
                             name: str, extra_args: tuple[str, ...] = ()) -> tuple[dict[str, Any],
                                                                                   WorkerProcess]:
    """n records and a backfill of them at ~64 records per 33 ms (about 10 s for the topic), 4 s after it
    got its partitions: well under way, far from done."""
    bs = kafka.bootstrap
    create_topics(bs, {topic_names["in"]: 4, topic_names["out"]: 4, topic_names["dlq"]: 1})
    produce(bs, topic_names["in"], requests(n, "synthetic", id_prefix=prefix))
    cfg = worker_config(bs, topic_names, model={"name": "synthetic", "options": {"a_ms": 20, "b_ms": 0.2}},
                        batching={"lanes": [{"name": "default", "max_batch_size": 64, "max_wait_ms": 5}]})
    w = WorkerProcess(cfg, tmp_path, command="backfill", name=name,
                      extra_args=["--verbose", *extra_args]).start()
    w.wait_assigned()
    time.sleep(4)
    return cfg, w


def test_backfill_killed_halfway_resumes(kafka, topic_names, tmp_path):
    bs, n = kafka.bootstrap, 20_000
    cfg, w = _slow_backfill_under_way(kafka, topic_names, tmp_path, n, "k", "killed")
    w.signal(signal.SIGKILL)
    w.wait(30)
    partial = len(read_all(bs, topic_names["out"], timeout=10, idle=1))
    assert 0 < partial < n, "the kill did not land mid-backfill; nothing was tested"
    w2 = WorkerProcess(cfg, tmp_path, command="backfill", name="rerun").start()
    assert w2.wait(300) == 0, w2.log()[-3000:]
    results = decode(read_all(bs, topic_names["out"], want=n, timeout=60))
    ids = collections.Counter(r["id"] for r in results)
    dupes = sum(c - 1 for c in ids.values())
    print(f"\n[backfill-kill] killed after {partial} results; rerun done: {len(ids)} ids, duplicates={dupes}")
    assert set(ids) == {f"k-{i}" for i in range(n)}


def test_backfill_assigned_again_mid_run_goes_on_from_its_commits(kafka, topic_names, tmp_path):
    """Another member joins the backfill's group (the eager range assignor takes every partition back and
    hands out new ones) and leaves: the backfill gets its partitions assigned again and goes on from what it
    committed, not from the start of its range (everything done so far processed twice)."""
    bs, n = kafka.bootstrap, 20_000
    cfg, w = _slow_backfill_under_way(kafka, topic_names, tmp_path, n, "a", "reassigned")
    group = f"{cfg['kafka']['group_id']}-backfill"
    other = member_with_partitions(bs, group, topic_names["in"], "range")
    try:
        done_before = sum(committed_offsets(bs, group, topic_names["in"]).values())
    finally:
        other.close()  # leaves: the backfill gets every partition again
    assert w.wait(300) == 0, w.log()[-3000:]
    assert 0 < done_before < n, "the other member did not join mid-backfill; nothing was tested"
    # start, after the join, after the leave
    assert w.log().count("partitions assigned") >= 3, w.log()[-3000:]
    results = decode(read_all(bs, topic_names["out"], want=n, timeout=60))
    ids = collections.Counter(r["id"] for r in results)
    dupes = sum(c - 1 for c in ids.values())
    print(f"\n[backfill-reassigned] {done_before} committed when the other member joined; duplicates={dupes}")
    assert set(ids) == {f"a-{i}" for i in range(n)}
    # Revokes commit what is done first: at most what was in flight at each handover comes twice.
    assert dupes < done_before // 2, (dupes, done_before)


def test_backfill_stopped_early_exits_1_and_from_timestamp_counts_from_there(kafka, topic_names, tmp_path):
    bs, n = kafka.bootstrap, 20_000
    cfg, w = _slow_backfill_under_way(kafka, topic_names, tmp_path, n, "s", "stopped", ("--from-beginning",))
    assert w.stop(60) == 1, w.log()[-3000:]  # SIGTERM mid-run: a graceful stop, but not a finished backfill
    assert "stopped before the end of" in w.log()

    # The Job retries with the same arguments: it goes on from the group's commits, --from-beginning or not
    # (it started over, and a Job killed every time never finished).
    group = f"{cfg['kafka']['group_id']}-backfill"
    done = sum(committed_offsets(bs, group, topic_names["in"]).values())
    assert 0 < done < n, "the stop did not land mid-backfill; nothing was tested"
    again = WorkerProcess(cfg, tmp_path, command="backfill", name="retried",
                          extra_args=["--from-beginning"]).start()
    assert again.wait(120) == 0, again.log()[-3000:]
    assert f"backfill: {n - done} records in 4 partitions" in again.log(), again.log()[-3000:]
    assert (
        "partitions go on from the commits of group" in again.log()
        and f"{n - done} records read" in again.log()
    )

    # --from-timestamp: only the records at or after it (the total, the records read, the results).
    time.sleep(0.05)
    since = int(time.time() * 1000)
    time.sleep(0.05)
    produce(bs, topic_names["in"], requests(40, "synthetic", id_prefix="new"))
    w2 = WorkerProcess(cfg, tmp_path, command="backfill", name="since",
                       extra_args=["--from-timestamp", str(since), "--group",
                                   f"since-{topic_names['run']}"]).start()
    assert w2.wait(120) == 0, w2.log()[-3000:]
    assert "backfill: 40 records in 4 partitions" in w2.log() and "40 records read" in w2.log()


def test_backfill_of_a_topic_written_in_transactions_exits_0(kafka, topic_names, tmp_path):
    """A transactional producer's commit marker takes the offset after its last record: the end snapshot (high
    watermark) is one past the last commit a consumer can make. The backfill never exited 0, nor did a
    rerun."""
    bs = kafka.bootstrap
    create_topics(bs, {topic_names["in"]: 2, topic_names["out"]: 2, topic_names["dlq"]: 1})
    p = Producer({"bootstrap.servers": bs, "transactional.id": f"upstream-{topic_names['run']}"})
    p.init_transactions(30)
    n = 0
    for txn in range(3):  # markers in the middle of the partitions too
        p.begin_transaction()
        for i in range(20):
            p.produce(topic_names["in"], msgspec.json.encode({"id": f"t{txn}-{i}", "inputs": [1.0, 2.0]}),
                      key=f"k{i}".encode())
            n += 1
        p.commit_transaction(30)
    ends = end_offsets(bs, topic_names["in"])
    assert sum(ends.values()) > n  # the markers
    cfg = worker_config(bs, topic_names, model={"name": "identity"})
    w = WorkerProcess(cfg, tmp_path, command="backfill").start()
    assert w.wait(120) == 0, w.log()[-3000:]
    assert f"{n} records read" in w.log() and f"backfill: {n}/{n} records" in w.log(), w.log()[-3000:]
    assert sorted(r["id"] for r in decode(read_all(bs, topic_names["out"], want=n, timeout=60))) == sorted(
        f"t{t}-{i}" for t in range(3) for i in range(20))
    rerun = WorkerProcess(cfg, tmp_path, command="backfill", name="rerun").start()
    assert rerun.wait(120) == 0, rerun.log()[-3000:]
    assert "0 records read" in rerun.log()


def test_backfill_starts_at_the_earliest_offset_whatever_auto_offset_reset_says(kafka, topic_names, tmp_path):
    """A live config with auto.offset.reset=latest and a backfill group without commits: the consumer began at
    the end, met EOF, and the backfill exited 0 having processed nothing."""
    bs, n = kafka.bootstrap, 200
    create_topics(bs, {topic_names["in"]: 2, topic_names["out"]: 2, topic_names["dlq"]: 1})
    produce(bs, topic_names["in"], requests(n, "identity", id_prefix="lt"))
    cfg = worker_config(bs, topic_names, model={"name": "identity"},
                        kafka={"consumer": {"auto.offset.reset": "latest"}})
    w = WorkerProcess(cfg, tmp_path, command="backfill").start()
    assert w.wait(180) == 0, w.log()[-3000:]
    assert f"{n} records read" in w.log(), w.log()[-3000:]
    assert len(read_all(bs, topic_names["out"], want=n, timeout=60)) == n
