"""Workers joining and leaving a consumer group mid-run: every id gets a result; duplicates only for
records in flight at a revoke (printed)."""

from __future__ import annotations

import collections
import threading
import time

import pytest

from tests.support.kafka_io import (
    WorkerProcess,
    create_topics,
    decode,
    end_offsets,
    member_with_partitions,
    read_all,
    worker_config,
)
from worker.app.load import produce, requests

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("assignor, n", [("cooperative-sticky", 50_000), ("range", 20_000)])
def test_three_workers_join_and_leave_during_run(kafka, topic_names, tmp_path, assignor, n):
    bs = kafka.bootstrap
    create_topics(bs, {topic_names["in"]: 6, topic_names["out"]: 6, topic_names["dlq"]: 1})
    cfg = worker_config(bs, topic_names,
                        kafka={"consumer": {"partition.assignment.strategy": assignor}},
                        model={"name": "identity"},
                        batching={"lanes": [{"name": "default", "max_batch_size": 256, "max_wait_ms": 5}],
                                  "max_in_flight": 5000},
                        delivery={"revoke_timeout_ms": 5000})
    rate = n / 12.0  # the run lasts ~12 s; members join and leave meanwhile
    producer = threading.Thread(target=produce, args=(bs, topic_names["in"],
                                                      requests(n, "identity", id_prefix="rb")),
                                kwargs={"rate": rate})
    workers = [WorkerProcess(cfg, tmp_path, name=f"{assignor}-w{i}") for i in range(3)]
    everyone = list(workers)
    try:
        workers[0].start()
        workers[0].wait_assigned()
        producer.start()
        time.sleep(2)
        workers[1].start()
        workers[1].wait_assigned()  # it holds partitions when it leaves below
        time.sleep(2)
        workers[2].start()
        workers[2].wait_assigned()
        time.sleep(2)
        assert workers[0].stop(60) == 0, workers[0].log()[-3000:]  # leaves mid-run
        time.sleep(2)
        workers[0] = WorkerProcess(cfg, tmp_path, name=f"{assignor}-w0-again").start()  # joins again
        everyone.append(workers[0])
        time.sleep(1)
        assert workers[1].stop(60) == 0, workers[1].log()[-3000:]
        producer.join(120)
        results = decode(read_all(bs, topic_names["out"], want=n, timeout=240))
    finally:
        for w in everyone:
            if w.proc is not None and w.proc.poll() is None:
                w.stop(60)
    ids = collections.Counter(r["id"] for r in results)
    missing = {f"rb-{i}" for i in range(n)} - set(ids)
    dupes = sum(c - 1 for c in ids.values())
    revokes = sum(w.log().count("partitions released") for w in everyone)
    print(f"\n[rebalance:{assignor}] sent={n} results={len(results)} distinct={len(ids)} "
          f"missing={len(missing)} duplicates={dupes} (records in flight at {revokes} revokes)")
    assert not missing, f"{len(missing)} ids never got a result, e.g. {sorted(missing)[:5]}"
    # Two members left mid-run, each releasing its partitions: the run did rebalance.
    assert revokes >= 2, f"only {revokes} partition releases: the group did not rebalance as scripted"
    # Bound: at most what one revoke can leave in flight (max_in_flight) per revoke.
    assert dupes <= 5000 * max(revokes, 1)


def test_partitions_paused_when_revoked_are_read_again_when_they_come_back(kafka, topic_names, tmp_path):
    """librdkafka keeps a partition's pause through a revoke and a new assign. An overloaded worker holds its
    partitions paused (backpressure) nearly all the time; another member takes some of them, stays until the
    worker has finished its other partitions (so nothing pauses and resumes them all again), and leaves.
    Before the fix they came back paused while the worker counted them as fetching: never read again."""
    bs, n = kafka.bootstrap, 6000
    create_topics(bs, {topic_names["in"]: 4, topic_names["out"]: 4, topic_names["dlq"]: 1})
    produce(bs, topic_names["in"], requests(n, "synthetic", id_prefix="pz"))
    cfg = worker_config(bs, topic_names, model={"name": "synthetic", "options": {"a_ms": 20, "b_ms": 0.3}},
                        batching={"max_in_flight": 50})
    w = WorkerProcess(cfg, tmp_path, name="paused").start()
    try:
        w.wait_assigned()
        time.sleep(2)  # under way, partitions paused most of the time (50 in flight at ~1,000 records/s)
        deadline = time.monotonic() + 60
        other = member_with_partitions(bs, cfg["kafka"]["group_id"], topic_names["in"], "cooperative-sticky")
        # The worker finishes the partitions it kept: no more results for 2 s.
        last, still_since = -1, time.monotonic()
        while time.monotonic() - still_since < 2 and time.monotonic() < deadline:
            other.poll(0.5)
            now = sum(end_offsets(bs, topic_names["out"]).values())
            if now != last:
                last, still_since = now, time.monotonic()
        assert 0 < last < n, f"{last} results when the other member left: nothing was tested"
        other.close()  # leaves: its partitions go back to the worker
        results = decode(read_all(bs, topic_names["out"], want=n, timeout=120))
        assert w.stop(60) == 0, w.log()[-3000:]
    finally:
        w.kill()
    ids = {r["id"] for r in results}
    assert ids == {f"pz-{i}" for i in range(n)}, f"{n - len(ids)} ids without a result\n{w.log()[-3000:]}"
