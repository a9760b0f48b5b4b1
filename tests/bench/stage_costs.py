"""Per-record CPU cost of each step the worker's loop thread runs, next to the raw loop's, without Kafka.

``python -m tests.bench.stage_costs [--records N]`` times each step over N identity requests of 100 bytes
(the pipeline benchmark's) in one thread, unprofiled, and prints microseconds per record. The producer is a
real confluent-kafka Producer pointed at a closed port: ``produce`` only enqueues, as it does against a
broker. The worker's steps are called through its own classes (Ingest.read, Intake, PriorityScheduler,
Emitter, Settling and Results.records_done), so the numbers follow the code as it changes. The requests
are read round-robin from 4 partitions, the worst case for the per-partition steps (librdkafka's
consume() returns a fetched partition's records together).
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
from confluent_kafka import Producer

from tests.bench.pipeline import requests
from worker.adapters.kafka_clients import PRODUCER_DEFAULTS
from worker.config import from_dict
from worker.core.offsets import OffsetTracker
from worker.core.records import Record, TopicPartition
from worker.core.scheduler import PriorityScheduler
from worker.emit import Emitter
from worker.intake import Intake
from worker.models.identity import IdentityModel
from worker.pipeline.delivery import AtLeastOnce
from worker.pipeline.ingest import Ingest
from worker.pipeline.partitions import PartitionTable
from worker.pipeline.results import Results
from worker.runner import GC_THRESHOLD

# Records per poll batch (kafka.poll_max_records' default).
POLL_BATCH = 1000


class _FakeMsg:
    __slots__ = ("_v", "_k", "_p", "_o")

    def __init__(self, v: bytes, k: bytes, p: int, o: int) -> None:
        self._v, self._k, self._p, self._o = v, k, p, o

    def value(self) -> bytes:
        return self._v

    def key(self) -> bytes:
        return self._k

    def topic(self) -> str:
        return "in"

    def partition(self) -> int:
        return self._p

    def offset(self) -> int:
        return self._o

    def timestamp(self) -> tuple[int, int]:
        return 1, 1795990000000

    def headers(self) -> list[tuple[str, bytes]] | None:
        return None

    def error(self) -> None:
        return None


def timed(n: int, fn: Callable[[], Any]) -> float:
    """CPU microseconds per record of this thread (time.thread_time: time this thread was not running
    because other jobs had the cores does not count, which keeps the figure steady on a shared machine)."""
    t0 = time.thread_time()
    fn()
    return (time.thread_time() - t0) / n * 1e6


def _round(msgs: list[_FakeMsg], n: int) -> tuple[list[tuple[str, float]], float]:
    """One measurement of every step on fresh state: (rows, raw loop us/record)."""
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
        for i in range(0, len(msgs), POLL_BATCH):
            recs.extend(ingest.read(msgs[i:i + POLL_BATCH], now))

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

    batches: list[Any] = []

    def take() -> None:
        while True:
            b = sched.next_batch(now + 1.0, idle=True)
            if b is None:
                return
            batches.append(b)

    rows.append(("next_batch (per record, batches of 256)", timed(n, take)))
    # The loop's side of settling, Results.records_done, on the tracker and partitions above (no
    # ledger or attempt counters: what the pipeline benchmark runs).
    loop = SimpleNamespace(partitions=parts, tracker=tracker,
                           gate=SimpleNamespace(delivered_many=lambda _recs: None))
    results = Results(loop, mode=None)  # type: ignore[arg-type]
    p_w = Producer(conf)
    em = Emitter(p_w, "out", "dlq", "identity", "1", "json", on_done=results.record_done,
                 on_failed=lambda r, e: None, on_done_many=results.records_done)
    wall = time.time() * 1000
    per_batch = [(b.records, [r.item for r in b.records]) for b in batches]
    rows.append(("  (of which: encoding the results, ResultEncoder.encode_ok)",
                 timed(n, lambda: [em.results.encode_ok(recs_b, outs_b, len(recs_b), now, 0.0001, now, wall)
                                   for recs_b, outs_b in per_batch] and None)))

    def emit() -> None:
        # What Results.complete_batch hands the emitter per batch (it encodes the results too).
        for recs_b, outs_b in per_batch:
            em.emit_ok_many(recs_b, outs_b, len(recs_b), now, 0.0001, now, wall)

    rows.append(("Emitter.emit_ok_many: encode + produce, one callback per batch", timed(n, emit)))
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
    args = ap.parse_args()
    n = args.records
    msgs = [_FakeMsg(v, k, i % 4, i // 4) for i, (k, v) in enumerate(requests(n))]
    # The garbage collector as the worker runs it (Runner._build_models): what is loaded is frozen.
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)
    results = [_round(msgs, n) for _ in range(max(1, args.rounds))]
    rows = [(name, min(r[0][i][1] for r in results)) for i, (name, _) in enumerate(results[0][0])]
    raw_us = min(r[1] for r in results)
    total = sum(us for name, us in rows if not name.startswith("  (of which"))
    print(f"\nper-record CPU, {n} identity requests of 100 B, one thread, CPU time, no profiler, minimum of "
          f"{len(results)} rounds\n")
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
