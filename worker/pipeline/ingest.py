"""From the consumer to the scheduler: one poll batch is read, tracked, admitted and queued per turn."""

from __future__ import annotations

import logging
from collections import Counter
from operator import attrgetter
from typing import Any

from confluent_kafka import KafkaError
from confluent_kafka import TopicPartition as KTP

from worker.core.records import Outcome, Record, TopicPartition
from worker.pipeline.context import Loop
from worker.pipeline.delivery import DeliveryMode
from worker.pipeline.results import Results

log = logging.getLogger("worker.runner")
_lane = attrgetter("lane")


def _unreadable_headers(tp: TopicPartition, offset: int) -> list[tuple[str, bytes]]:
    """confluent-kafka decodes header names as UTF-8 without checking the result (its c_headers_to_py), so a
    name another client wrote in another encoding makes ``headers()`` raise, at every restart. The record
    goes on without its headers (an ``x-priority`` among them is not seen)."""
    log.warning("headers of %s[%d]@%d cannot be read (a header name that is not UTF-8?): "
                "processed without them", tp.topic, tp.partition, offset)
    return []


class Ingest:
    def __init__(self, loop: Loop, mode: DeliveryMode, results: Results) -> None:
        self.loop = loop
        self.mode = mode
        self.results = results

    def poll(self) -> None:
        """Reads what the consumer has fetched (at most up to the in-flight bound) and ingests it."""
        loop = self.loop
        cfg, consumer, tracker = loop.cfg, loop.consumer, loop.tracker
        # While anything is in flight (queued, on a device, or waiting for its delivery to settle) the loop
        # polls in short steps: a device that finishes cannot wake a consumer.poll(). Checking the device
        # instead misses the batches it has not picked up yet.
        busy = tracker.in_flight() > 0 or not loop.dispatch.idle()
        timeout = 0.002 if busy else cfg.kafka.poll_timeout_ms / 1000.0
        # consume(n, t) waits for all n records or the whole timeout, which would add up to poll_timeout_ms to
        # every record at light load. poll() returns on the first record; then consume(n - 1, 0) takes what is
        # already fetched without waiting.
        first = consumer.poll(timeout)
        msgs = [first] if first is not None else []
        # Never read much past the in-flight bound: it is what keeps memory bounded under overload.
        room = max(1, cfg.batching.max_in_flight - tracker.in_flight())
        want = min(cfg.kafka.poll_max_records, room)
        if first is not None and want > 1:
            loop.partitions.clear_rewound()
            msgs.extend(consumer.consume(want - 1, 0))
            rewound = loop.partitions.take_rewound()
            if rewound:
                msgs = self._drop_rewound(msgs, rewound)
        if msgs:
            loop.broker_ok = True
            self.ingest(msgs)

    def _drop_rewound(self, msgs: list[Any], rewound: dict[TopicPartition, int | None]) -> list[Any]:
        """A rewind served inside consume() (a revoke whose checkpoint failed) sought partitions back, but
        poll() had already returned a record of them, and consume() may return some read before the callback:
        tracked under the new epoch they would be processed twice (or out of order). Drop every message of
        those partitions from this turn and seek to the first one dropped where that is before the rewind's
        target (or where the rewind had nothing to seek to): whatever they were, they are read again."""
        keep: list[Any] = []
        first: dict[TopicPartition, int] = {}
        parts = self.loop.partitions
        for m in msgs:
            tp = TopicPartition(m.topic(), m.partition())
            if m.error() is None and tp in rewound:
                if parts.is_assigned(tp) and tp not in first:
                    first[tp] = m.offset()
                continue
            keep.append(m)
        for tp, off in first.items():
            target = rewound[tp]
            to = off if target is None else min(off, target)
            try:
                self.loop.consumer.seek(KTP(tp.topic, tp.partition, to))
            except Exception as e:
                self.mode.stop_committing(
                    f"exactly-once: could not rewind {tp.topic}[{tp.partition}] after an abort: {e}")
        return keep

    def ingest(self, msgs: list[Any]) -> None:
        now = self.loop.clock.monotonic()
        loop = self.loop
        outcomes: list[Outcome] = []
        recs = self.read(msgs, now)
        loop.stats.records_in += len(recs)
        admitted = loop.intake.admit_many(recs, now, outcomes)
        if admitted:
            admitted = loop.gate.admit(admitted, outcomes, ack=self._ack_delivered_before,
                                       isolate=loop.dispatch.isolate)
        if admitted:
            for late in loop.dispatch.add(admitted, now):
                outcomes.append(Outcome(late, "expired", error="deadline passed", dlq_stage="expired"))
            for lane, n in Counter(map(_lane, admitted)).items():
                loop.metrics.records_in(lane, n)
        if outcomes:
            self.results.emit_all(outcomes, now)

    def read(self, msgs: list[Any], now: float) -> list[Record]:
        """The poll batch's records to process, in the order read, each tracked under its partition's epoch
        (``DeliveryMode.track_run``, once per partition of the batch); consumer errors and end-of-partition
        events are served here, and a backfill's records past its end snapshot are left untracked."""
        loop = self.loop
        live, stop_at = loop.partitions.live, loop.stop_at
        recs: list[Record] = []
        keep = recs.append
        # Per partition of the batch: its Partition and the offsets read, tracked together after the loop.
        runs: dict[tuple[str, int], tuple[Any, list[int]]] = {}
        # A poll batch holds runs of one partition: its entry is looked up once per run.
        run_key: tuple[str, int] | None = None
        part: Any = None
        offsets: list[int] = []
        tp, epoch = TopicPartition("", -1), 0
        for m in msgs:
            err = m.error()
            if err is not None:
                self._consume_error(m, err)
                continue
            key = (m.topic(), m.partition())
            if key != run_key:
                run_key = key
                run = runs.get(key)
                if run is None:
                    part = live(key)
                    run = runs[key] = (part, [])
                part, offsets = run
                if part is not None:
                    # One TopicPartition per partition, not one per record; no callback runs in this loop,
                    # so the epoch holds for the batch.
                    tp, epoch = part.tp, part.epoch
            if part is None:
                continue  # a message of a partition revoked while it was in the fetch batch
            offset = m.offset()
            if stop_at is not None:
                end = stop_at.get(tp, 0)
                if offset >= end:
                    # Backfill: past the end snapshot taken at start; leave it for the live workers.
                    part.reached = True
                    continue
                if offset + 1 >= end:
                    part.reached = True
            offsets.append(offset)
            ts_type, ts = m.timestamp()
            try:
                headers = m.headers() or []
            except Exception:  # noqa: BLE001 - one record's headers must not stop the partition for good
                headers = _unreadable_headers(tp, offset)
            keep(Record(tp, offset, m.value(), m.key(), headers, now, ts if ts_type else None, epoch))
        track_run = self.mode.track_run
        skip: dict[TopicPartition, set[int]] = {}
        for part, offsets in runs.values():
            if not offsets:
                continue
            skipped = track_run(part, offsets)
            last = len(offsets) - 1
            if skipped:
                dropped = skip[part.tp] = set(skipped)
                while last in dropped:
                    last -= 1
            if last >= 0:
                part.position = offsets[last] + 1
        return self._without(recs, skip) if skip else recs

    @staticmethod
    def _without(recs: list[Record], skip: dict[TopicPartition, set[int]]) -> list[Record]:
        """``recs`` less those the delivery mode did not track: per partition, the indexes among that
        partition's records, in the order read (a record read twice in one batch is dropped the second
        time only)."""
        seen: dict[TopicPartition, int] = {}
        kept: list[Record] = []
        for r in recs:
            i = seen.get(r.tp, 0)
            seen[r.tp] = i + 1
            if i not in skip.get(r.tp, ()):
                kept.append(r)
        return kept

    def _consume_error(self, m: Any, err: Any) -> None:
        """A consumer error or event in the poll batch: a broker that does not answer, a partition's end (a
        backfill notes it reached), a fatal error (the worker stops)."""
        loop = self.loop
        if err.code() in (KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT):
            loop.broker_ok = False
        if err.code() == KafkaError._PARTITION_EOF:
            stop_at = loop.stop_at
            if stop_at is not None:
                eof_tp = TopicPartition(m.topic(), m.partition())
                if m.offset() >= stop_at.get(eof_tp, 0):
                    loop.partitions.mark_reached(eof_tp)
        else:
            log.warning("consume error: %s", err)
            if err.fatal():
                loop.lifecycle.fail(f"fatal consumer error: {err}")

    def _ack_delivered_before(self, rec: Record) -> None:
        """The ledger says the record's result was delivered before (redelivery after a crash or rebalance).
        """
        self.loop.tracker.ack(rec.tp, rec.offset)
