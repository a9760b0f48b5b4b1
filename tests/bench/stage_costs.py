"""Per-record CPU cost of each step the worker's loop thread runs, next to the raw loop's, without Kafka.

``python -m tests.bench.stage_costs [--records N]`` times each step over N identity requests of 100 bytes
(the pipeline benchmark's) in one thread, unprofiled, and prints microseconds per record. The producer is a
real confluent-kafka Producer pointed at a closed port: ``produce`` only enqueues, as it does against a
broker. The worker's steps are called through its own classes (Ingest.read, Intake, PriorityScheduler,
Results.complete_batch and records_done, Emitter, Settling), so the numbers follow the code as it changes.

The requests are real consumer messages: written to 4 partitions of librdkafka's in-process mock cluster
(``test.mock.num.brokers``, no broker to start) and read back with ``consume()`` in poll batches of
``kafka.poll_max_records``, so their accessors and the runs of one partition in a poll batch are what the
worker gets. ``--fake-messages`` reads Python stand-ins instead, round-robin from the 4 partitions (each
run one record, the worst case for the per-partition steps; their accessors are Python calls, slower than
the client's).
"""

from __future__ import annotations

import argparse
import gc
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import msgspec
from confluent_kafka import Consumer, Producer

from tests.bench.pipeline import requests
from tests.unit.fakes_kafka import FakeMessage
from worker.config.settings import from_dict
from worker.core.offsets import OffsetTracker
from worker.core.ports import NullMetrics
from worker.core.records import Record, TopicPartition
from worker.core.scheduler import PriorityScheduler
from worker.kafka.clients import PRODUCER_DEFAULTS
from worker.models.identity import IdentityModel
from worker.output.emit import Emitter
from worker.pipeline.context import RunStats
from worker.pipeline.delivery import AtLeastOnce
from worker.pipeline.ingest import Ingest
from worker.pipeline.intake import Intake
from worker.pipeline.partitions import PartitionTable
from worker.pipeline.results import Results
from worker.pipeline.runner import GC_THRESHOLD

# Records per poll batch (kafka.poll_max_records' default).
POLL_BATCH = 1000


def timed(n: int, fn: Callable[[], Any]) -> float:
    """CPU microseconds per record of this thread (time.thread_time: time this thread was not running
    because other jobs had the cores does not count, which keeps the figure steady on a shared machine)."""
    t0 = time.thread_time()
    fn()
    return (time.thread_time() - t0) / n * 1e6


def mock_cluster_batches(reqs: list[tuple[bytes, bytes]], partitions: int = 4) -> list[list[Any]]:
    """``reqs`` (key, value) written round-robin to ``partitions`` partitions of an in-process mock cluster
    and read back: the poll batches ``consume(POLL_BATCH)`` returned, errors left out."""
    quiet = {"log_level": 0}
    producer = Producer({"test.mock.num.brokers": 1, **quiet})
    broker = next(iter(producer.list_topics(timeout=10).brokers.values()))
    bootstrap = f"{broker.host}:{broker.port}"
    if len(producer.list_topics("in", timeout=10).topics["in"].partitions) < partitions:
        raise SystemExit(f"the mock cluster made topic 'in' with fewer than {partitions} partitions")
    for i, (k, v) in enumerate(reqs):
        producer.produce("in", v, k, i % partitions)
        if i % 10_000 == 0:
            producer.poll(0)
    if producer.flush(30):
        raise SystemExit("the mock cluster did not take every request within 30 s")
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "stage-costs",
                         "auto.offset.reset": "earliest", "enable.auto.commit": False, **quiet})
    consumer.subscribe(["in"])
    batches: list[list[Any]] = []
    got, deadline = 0, time.monotonic() + 60
    while got < len(reqs):
        if time.monotonic() > deadline:
            raise SystemExit(f"read {got} of {len(reqs)} requests back from the mock cluster in 60 s")
        batch = [m for m in consumer.consume(POLL_BATCH, 1.0) if m.error() is None]
        if batch:
            batches.append(batch)
            got += len(batch)
    consumer.close()
    return batches


def _round(batches: list[list[Any]], n: int) -> tuple[list[tuple[str, float]], float]:
    """One measurement of every step on fresh state: (rows, raw loop us/record)."""
    msgs = [m for b in batches for m in b]
    conf = {**PRODUCER_DEFAULTS, "bootstrap.servers": "127.0.0.1:1",
            "queue.buffering.max.messages": 2_000_000,
            "queue.buffering.max.kbytes": 2_097_151, "log_level": 0}
    rows: list[tuple[str, float]] = []

    # ---- the raw loop's whole per-record job
    dec, enc = msgspec.json.Decoder(), msgspec.json.Encoder()
    p_raw = Producer(conf)

    def raw() -> None:
        for m in msgs:
            req = dec.decode(m.value())
            value = enc.encode({"id": req["id"], "status": "ok", "outputs": req.get("inputs"),
                                "model": "identity",
                                "source": {"topic": m.topic(), "partition": m.partition(),
                                           "offset": m.offset()}})
            p_raw.produce("out", value=value, key=m.key())

    raw_us = timed(n, raw)

    # ---- the worker's steps, in the order the loop thread runs them
    cfg = from_dict({"kafka": {"input_topics": ["in"]}, "model": {"name": "identity"},
                     "batching": {"lanes": [{"name": "default", "max_batch_size": 256, "max_wait_ms": 5}]}},
                    environ={})
    model = IdentityModel()
    intake = Intake(cfg, model)
    sched = PriorityScheduler(cfg.batching.lanes, "default", "fixed", 0)
    tracker = OffsetTracker()
    cv = threading.Condition()
    now = time.monotonic()
    # The loop's consume side, Ingest.read: partitions looked up, offsets tracked through the at-least-once
    # delivery mode (once per partition of the poll batch), Records made.
    parts = PartitionTable()
    parts.assign({TopicPartition(m.topic(), m.partition()) for m in msgs})
    read_loop: Any = SimpleNamespace(partitions=parts, tracker=tracker, stop_at=None, clock=time)
    mode = AtLeastOnce(read_loop, make_producer=lambda *_a, **_k: None)
    ingest = Ingest(read_loop, mode, results=None)  # type: ignore[arg-type]
    recs: list[Record] = []

    def read() -> None:
        for batch in batches:
            recs.extend(ingest.read(batch, now))

    rows.append(("consume side: Ingest.read (Records, track_run per partition)", timed(n, read)))
    rejected: list[Any] = []
    rows.append(("Intake.admit_many (validate Request, route, model.decode)",
                 timed(n, lambda: intake.admit_many(recs, now, rejected) and None)))
    assert not rejected, rejected[:1]

    def schedule() -> None:
        with cv:
            for r in recs:
                sched.add(r, now)
            cv.notify_all()

    rows.append(("PriorityScheduler.add (under the lock)", timed(n, schedule)))

    taken: list[Any] = []

    def take() -> None:
        while True:
            b = sched.next_batch(now + 1.0, idle=True)
            if b is None:
                return
            taken.append(b)

    rows.append(("next_batch (per record, batches of 256)", timed(n, take)))
    # The loop's side of a finished batch (Results.complete_batch: epochs, failed outputs, the delivery
    # mode's batch path into the emitter) and of settling (Results.records_done), on the tracker and
    # partitions above; no metrics, ledger, cache or attempt counters: what the pipeline benchmark runs.
    loop: Any = SimpleNamespace(partitions=parts, tracker=tracker, clock=time, metrics=NullMetrics(),
                                stats=RunStats(),
                                gate=SimpleNamespace(cache=None, delivered_many=lambda _recs: None))
    results = Results(loop, mode=AtLeastOnce(loop, make_producer=lambda *_a, **_k: None))
    p_w = Producer(conf)
    em = loop.emitter = Emitter(p_w, "out", "dlq", "identity", "1", "json", on_done=results.record_done,
                                on_failed=lambda r, e: None, on_done_many=results.records_done)
    wall = time.time() * 1000
    per_batch = [(b, [r.item for r in b.records]) for b in taken]
    rows.append(("  (of which: encoding the results, ResultEncoder.encode_ok)",
                 timed(n, lambda: [em.results.encode_ok(b.records, outs_b, len(b), now, 0.0001, now, wall)
                                   for b, outs_b in per_batch] and None)))

    def complete() -> None:
        for b, outs_b in per_batch:
            results.complete_batch(b, outs_b, {"infer": 0.0001})

    rows.append(("Results.complete_batch: emit_ok_many (encode + produce, one callback)",
                 timed(n, complete)))
    # Settling: once the producer has drained, every record sent on it is confirmed in one loop (there is no
    # report per message to serve: delivery.report.only.error). No broker here: the drain is assumed.
    slot = em.cur

    rows.append(("settling: Settling.confirm -> Results.records_done -> ack_many",
                 timed(n, lambda: em.settling.confirm(slot) and None)))
    assert tracker.in_flight() == 0, "settling left records unconfirmed"
    gc.collect()  # what this round kept alive goes before the next round
    return rows, raw_us


def main() -> int:

    ap = argparse.ArgumentParser()
    ap.add_argument("--records", type=int, default=50_000)
    ap.add_argument("--rounds", type=int, default=3,
                    help="measure this many times on fresh state and report each step's minimum: on a shared "
                         "machine the minimum is the figure least disturbed by other jobs")
    ap.add_argument("--fake-messages", action="store_true",
                    help="Python stand-ins for the consumer's messages, round-robin from 4 partitions, "
                         "instead of messages read from librdkafka's mock cluster")
    args = ap.parse_args()
    n = args.records
    reqs = list(requests(n))
    if args.fake_messages:
        fakes: list[Any] = [FakeMessage("in", i % 4, i // 4, v, k, timestamp_ms=1795990000000)
                            for i, (k, v) in enumerate(reqs)]
        batches = [fakes[i:i + POLL_BATCH] for i in range(0, n, POLL_BATCH)]
    else:
        batches = mock_cluster_batches(reqs)
    # The garbage collector as the worker runs it (Runner._build_models): what is loaded is frozen.
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)
    results = [_round(batches, n) for _ in range(max(1, args.rounds))]
    rows = [(name, min(r[0][i][1] for r in results)) for i, (name, _) in enumerate(results[0][0])]
    raw_us = min(r[1] for r in results)
    total = sum(us for name, us in rows if not name.startswith("  (of which"))
    source = ("Python stand-ins, round-robin" if args.fake_messages
              else f"read from a mock cluster in {len(batches)} poll batches")
    print(f"\nper-record CPU, {n} identity requests of 100 B ({source}), one thread, CPU time, no profiler, "
          f"minimum of {len(results)} rounds\n")
    print(f"  {'step':<70} {'us/record':>9}")
    for name, us in rows:
        print(f"  {name:<70} {us:9.2f}")
    print(f"  {'worker loop-thread steps, total':<70} {total:9.2f}  (max {1e6 / total:,.0f} records/s)")
    print(f"  {'raw loop: decode + encode dict + produce (no callback)':<70} {raw_us:9.2f}  "
          f"(max {1e6 / raw_us:,.0f} records/s)")
    print("\n(not included: consume() itself, Producer.poll (it serves failure reports only), GIL hand-offs "
          "with the device threads, metrics)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
