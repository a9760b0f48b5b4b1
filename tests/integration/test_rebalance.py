"""Workers joining and leaving a consumer group mid-run: every id gets a result; duplicates only for
records in flight at a revoke (printed)."""

from __future__ import annotations

import collections
import threading
import time

import pytest

from tests.support.kafka_io import WorkerProcess, create_topics, decode, read_all, worker_config
from worker.load import produce, requests

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
                                                      requests(n, "identity", id_prefix="rb")), kwargs={"rate": rate})
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
    print(f"\n[rebalance:{assignor}] sent={n} results={len(results)} distinct={len(ids)} missing={len(missing)} "
          f"duplicates={dupes} (records in flight at {revokes} revokes)")
    assert not missing, f"{len(missing)} ids never got a result, e.g. {sorted(missing)[:5]}"
    # Two members left mid-run, each releasing its partitions: the run did rebalance.
    assert revokes >= 2, f"only {revokes} partition releases: the group did not rebalance as scripted"
    # Bound: at most what one revoke can leave in flight (max_in_flight) per revoke.
    assert dupes <= 5000 * max(revokes, 1)
