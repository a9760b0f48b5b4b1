"""Exactly-once delivery: results, dead letters and input offsets commit in one Kafka transaction
(worker/output/transactions.py keeps the reorder buffer and drives the producer's transaction calls).

A failed delivery aborts the transaction and every assigned partition is read again from its last commit
(a rewind); results of an aborted transaction are invisible to ``read_committed`` readers.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Collection, Iterable
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka import TopicPartition as KTP

from worker.core.records import Outcome, Record, TopicPartition
from worker.kafka.clients import retry_transient, transactional_extra
from worker.output.emit import FatalDeliveryError
from worker.output.transactions import TransactionalCommitter, TransactionFailed
from worker.pipeline.context import Loop
from worker.pipeline.delivery import DeliveryMode, MakeProducer
from worker.pipeline.partitions import Partition
from worker.timing.clock import Deadline

log = logging.getLogger("worker.runner")
# A failed delivery aborts the transaction and the records are read again; this many such aborts in a row
# without a commit between them (the same failure each time, say a topic that refuses the record) end the
# worker instead, as max_retries failed deliveries do in at-least-once mode.
DELIVERY_ABORTS_MAX = 5


class ExactlyOnce(DeliveryMode):
    def __init__(self, loop: Loop, make_producer: MakeProducer, group_id: str) -> None:
        super().__init__(loop, make_producer)
        self._group_id = group_id
        self.txn: TransactionalCommitter | None = None  # made by open()
        self.abort_pending: str | None = None  # a delivery failed: abort at the end of the turn
        self.delivery_aborts = 0  # such aborts in a row, without a commit between them

    @property
    def _txn(self) -> TransactionalCommitter:
        assert self.txn is not None, "ExactlyOnce.open() makes the transaction"
        return self.txn

    def open(self) -> None:
        cfg = self.loop.cfg
        tid = cfg.delivery.transactional_id or f"{self._group_id}-{socket.gethostname()}"
        self.producer = self._make_producer(cfg, **transactional_extra(cfg, tid))
        self.txn = TransactionalCommitter(self.producer, self.loop.consumer)
        self.txn.init()
        log.info("exactly-once mode", extra={"transactional_id": tid})

    def emitter_options(self) -> dict[str, Any]:
        # A delivery that failed inside a transaction cannot be retried in it (librdkafka puts the transaction
        # in an abortable state): on_failed aborts instead. One transactional producer, never replaced.
        return {"new_producer": None, "max_retries": 0}

    def replace_consumer(self, consumer: Any) -> None:
        self._txn.consumer = consumer

    def stopping(self, deadline: Deadline) -> None:
        self._txn.deadline = deadline

    def close(self) -> None:
        if self.txn is not None:
            self.txn.close()

    # ---- records and outcomes
    def track(self, part: Partition, offset: int) -> bool:
        if not self.tracker.track(part.tp, offset):
            # Read again, already tracked (and processed, or on its way) after a rewind inside consume():
            # not a second result.
            return False
        self._txn.track(part.tp, offset)
        if part.first_read is None:
            part.first_read = offset
        return True

    def track_run(self, part: Partition, offsets: list[int]) -> Collection[int]:
        if not self.tracker.track_run(part.tp, offsets):
            return super().track_run(part, offsets)  # some were tracked already: one at a time
        tp, track = part.tp, self._txn.track
        for offset in offsets:
            track(tp, offset)
        if part.first_read is None:
            part.first_read = offsets[0]
        return ()

    def emit_ok(self, recs: list[Record], outs: list[Any], n: int, closed: float, infer_s: float, now: float,
                wall_ms: float) -> Iterable[int]:
        return range(len(recs))  # every outcome goes through the reorder buffer

    def emit(self, outcome: Outcome, now: float, wall_ms: float) -> Iterable[Outcome]:
        emit = self.loop.emitter.emit
        for ordered in self._txn.release(outcome):
            yield emit(ordered, now, wall_ms)

    def on_failed(self, rec: Record, err: str) -> None:
        if self.delivery_aborts < DELIVERY_ABORTS_MAX:
            # Abort the transaction and read again from the last commit, at the end of this loop turn (this
            # runs inside the producer's poll). A failure that comes back every time still ends the worker,
            # after DELIVERY_ABORTS_MAX aborts in a row without a commit.
            self.abort_pending = err
            return
        super().on_failed(rec, err)

    def on_refused(self, e: Exception) -> None:
        if not isinstance(e, FatalDeliveryError) or self.loop.lifecycle.fatal is not None:
            return
        if self._abortable(e):
            self.abort_pending = str(e)  # the release that follows aborts the transaction (and clears it)
            return
        self.loop.lifecycle.fail(str(e))
        # The open transaction may hold part of what the refused record owes (its error result, its dead
        # letter refused): committed, that would be visible while the record's offset is not, and the restart
        # would produce it again. Commit nothing more: closing aborts it.
        self.no_commit = True

    def _abortable(self, e: FatalDeliveryError) -> bool:
        """Once a message of the open transaction timed out, librdkafka refuses every produce() with _STATE
        ("Erroneous state") until the transaction is aborted, before the failure report is served: a failed
        delivery (abort, rewind), not a refused message. Emitter raises FatalDeliveryError ``from None``, so
        the producer's error is the exception's context."""
        ctx = e.__context__
        return (self.delivery_aborts < DELIVERY_ABORTS_MAX
                and isinstance(ctx, KafkaException) and bool(ctx.args)
                and isinstance(ctx.args[0], KafkaError) and ctx.args[0].code() == KafkaError._STATE)

    def end_of_turn(self) -> None:
        if self.abort_pending is not None and self.loop.lifecycle.fatal is None:
            self._abort_for_failed_delivery()

    # ---- revoke, commits, rewinds
    def settled(self, tp: TopicPartition, first_dropped: int | None) -> bool:
        # Enough once every record before the first dropped one has been produced (it left the reorder
        # buffer); the checkpoint flushes and commits them. Waiting for the one transactional producer to
        # drain never ends while other partitions keep producing.
        q = self._txn.order.get(tp)
        head = q[0] if q else None
        return head is None or (first_dropped is not None and head >= first_dropped)

    def release(self, tps: set[TopicPartition], graceful: bool) -> None:
        self.tracker.revoke(tps)
        self._txn.drop(tps)
        if not graceful:
            # The open transaction holds results of these partitions, whose offsets it can no longer commit
            # (the new owner produces them again): committed later, they would be visible twice. Abort it and
            # read the partitions kept again from their last commit.
            self._abort_transaction()

    def _commit(self, only: set[TopicPartition] | None, sync: bool, flush_s: float, periodic: bool) -> None:
        """``flush_s``: how long produced results may take to be delivered (a revoke or a shutdown passes what
        is left of its budget); later, the transaction is aborted and the records are read again.
        ``periodic``: the loop's periodic checkpoint, which may commit past transaction markers
        (``step_over_markers``)."""
        if self.abort_pending is not None:
            # librdkafka refuses to commit a transaction with a failed delivery (it must be aborted): abort
            # now rather than send a commit that fails and then abort anyway.
            self._abort_for_failed_delivery()
            return
        t0 = self.loop.clock.monotonic()
        # Every produced result must be delivered before its offset can go into the transaction.
        left = self.loop.emitter.flush(flush_s)
        if left:
            # Committing now would commit those results (commit_transaction flushes them itself) without the
            # offsets that cover them: abort, and read again from the last commit.
            log.warning("exactly-once checkpoint: %d messages still undelivered after %.0f s; aborting", left,
                        flush_s)
            self._abort_transaction()
            return
        if self.abort_pending is not None:
            # A failure report served by that flush: the commit would fail (the transaction must be aborted).
            self._abort_for_failed_delivery()
            return
        offsets = self.tracker.committable()
        if periodic:
            self.step_over_markers(offsets)
        loop = self.loop
        try:
            ok = self._txn.checkpoint(offsets)
        except TransactionFailed as e:
            loop.lifecycle.fail(str(e))
            return
        if ok:
            self.delivery_aborts = 0
            self.tracker.mark_committed(offsets)
            loop.partitions.set_committed(offsets)
            loop.stats.commits += 1
            loop.metrics.gauge("commit_seconds", loop.clock.monotonic() - t0)
        else:
            # The failed commit aborted the transaction, and with it any failed delivery reported meanwhile.
            self.abort_pending = None
            loop.metrics.event("commit_failures")
            self._rewind()

    def _abort_for_failed_delivery(self) -> None:
        log.warning("exactly-once: a result was not delivered (%s); aborting the transaction",
                    self.abort_pending)
        self.abort_pending = None
        self.delivery_aborts += 1
        self._abort_transaction()

    def _abort_transaction(self) -> None:
        """Abort the open transaction and read every assigned partition again from its last commit."""
        try:
            self._txn.abort()
        except TransactionFailed as e:
            self.loop.lifecycle.fail(str(e))
            return
        self.abort_pending = None  # the failed deliveries were in the aborted transaction
        self.loop.metrics.event("commit_failures")
        self._rewind()

    def _rewind(self) -> None:
        """Forget everything in flight and read again from the committed offsets."""
        loop = self.loop
        parts = loop.partitions
        tps = set(parts.assigned)
        loop.dispatch.clear(tps)
        self.tracker.revoke(tps)
        self._txn.drop(tps)
        first_read = parts.rewind(tps)
        consumer = loop.consumer
        try:
            committed = retry_transient(consumer.committed, [KTP(t, p) for t, p in tps], timeout=30)
            for k in committed:
                tp = TopicPartition(k.topic, k.partition)
                # Without a commit: the first offset read since the assign (or the last rewind), where
                # auto.offset.reset or a backfill's start put the consumer; nothing read, nothing to seek.
                to = k.offset if k.offset >= 0 else first_read.get(tp)
                parts.note_rewound(tp, to)
                if to is not None:
                    consumer.seek(KTP(k.topic, k.partition, to))
                    # Backfill: its end counts again once re-read (the seek brings the EOF event back).
                    parts.unmark_reached(tp)
        except Exception as e:
            # The consumer would go on from its fetch position with nothing tracked before it, and the next
            # checkpoint would commit past records whose results the abort discarded (never visible). Commit
            # nothing more and exit 1: the next process starts from the committed offsets.
            self.stop_committing(
                f"exactly-once: could not rewind to the committed offsets after an abort: {e}")
            return
        log.warning("rewound to the committed offsets after an aborted transaction",
                    extra={"partitions": len(tps)})
