"""How results and offsets reach Kafka: one ``DeliveryMode`` per ``delivery.mode``, chosen once.

At-least-once (``AtLeastOnce``): result/DLQ produced -> delivered (the emitter settles it) -> tracker.ack
-> the contiguous done prefix is committed every ``commit_interval_ms``, on revoke and on shutdown, never
past a gap. Exactly-once (``worker.pipeline.exactly_once``): the same prefix goes into the producer's
transaction with the results it covers.

The loop calls the same hooks in both modes: ``track`` / ``track_run`` (records read), ``emit_ok`` /
``emit`` (outcomes), ``on_failed`` / ``on_refused`` (a delivery failed, the producer refused a message),
``end_of_turn``, ``settled`` / ``flush`` / ``commit`` (revoke, shutdown, the periodic commit) and
``release``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka import TopicPartition as KTP

from worker.core.records import Outcome, Record, TopicPartition
from worker.output.emit import FatalDeliveryError
from worker.pipeline.context import Loop
from worker.pipeline.partitions import Partition
from worker.timing.clock import Deadline

log = logging.getLogger("worker.runner")
MakeProducer = Callable[..., Any]


class DeliveryMode:
    def __init__(self, loop: Loop, make_producer: MakeProducer) -> None:
        self.loop = loop
        self.tracker = loop.tracker
        self._make_producer = make_producer
        self.producer: Any = None
        self.spare_producer: Any = None
        # when the last commit was sent (the periodic commit's clock)
        self.last_commit = loop.clock.monotonic()
        # Set when the consumer's position can no longer be trusted (a rewind that could not seek): nothing is
        # committed any more, the worker exits 1 and the next process starts from the committed offsets.
        self.no_commit = False

    # ---- setup and teardown
    def open(self) -> None:
        """Makes the producers (the consumer exists)."""
        raise NotImplementedError

    def emitter_options(self) -> dict[str, Any]:
        raise NotImplementedError

    def replace_consumer(self, consumer: Any) -> None:
        """The consumer was replaced (Membership): what the old one had on its way is not reported."""

    def stopping(self, deadline: Deadline) -> None:
        """The drain started: nothing waits past ``deadline``."""

    def close(self) -> None:
        """Closing: what is open is abandoned (the producers are flushed by the runner)."""

    # ---- records and outcomes
    def track(self, part: Partition, offset: int) -> bool:
        """A record read: tracked. False: it is not processed (already tracked)."""
        raise NotImplementedError

    def track_run(self, part: Partition, offsets: list[int]) -> Collection[int]:
        """The offsets one poll batch read of ``part``, in the order read: ``track`` for each. Returns the
        indexes in ``offsets`` of the records not to be processed (``track`` said False); empty in the
        common case."""
        return [i for i, o in enumerate(offsets) if not self.track(part, o)]

    def emit_ok(self, recs: list[Record], outs: list[Any], n: int, closed: float, infer_s: float, now: float,
                wall_ms: float) -> Iterable[int]:
        """The ok results of a batch; returns the indices of those for the general path (``emit``)."""
        raise NotImplementedError

    def emit(self, outcome: Outcome, now: float, wall_ms: float) -> Iterable[Outcome]:
        """Produces what ``outcome`` allows now; yields the outcomes sent."""
        raise NotImplementedError

    def on_failed(self, rec: Record, err: str) -> None:
        """A result (or dead letter) of a current record could not be delivered: the worker stops, and the
        record, never done, is not committed past."""
        self.loop.lifecycle.fail(
            f"giving up delivering the result of {rec.tp.topic}[{rec.tp.partition}]@{rec.offset}: {err}")

    def on_refused(self, e: Exception) -> None:
        """A message the producer refuses ends the worker (exit 1), raised in a loop turn or while serving
        results inside a rebalance callback (which must not swallow it)."""
        if isinstance(e, FatalDeliveryError) and self.loop.lifecycle.fatal is None:
            self.loop.lifecycle.fail(str(e))

    def end_of_turn(self) -> None:
        """After each loop turn."""

    # ---- revoke, shutdown, commits
    def settled(self, tp: TopicPartition, first_dropped: int | None) -> bool:
        """Revoke: everything of ``tp`` before its first dropped record got as far as it gets before a
        commit."""
        raise NotImplementedError

    def flush(self, seconds: float) -> None:
        """Before a revoke's or the shutdown's commit: delivery reports of what was produced."""

    def release(self, tps: set[TopicPartition], graceful: bool) -> None:
        """The partitions are gone (their table entries released already)."""
        raise NotImplementedError

    def commit_due(self, now: float) -> bool:
        return now - self.last_commit >= self.loop.cfg.kafka.commit_interval_ms / 1000.0

    def commit(self, only: set[TopicPartition] | None = None, sync: bool = True, flush_s: float = 30.0,
               step: bool = True) -> None:
        """Commit the done prefix. ``sync=False`` (the periodic commit): the request is sent and the loop goes
        on, and the outcome is recorded when poll() serves its report. Revoke and shutdown commit
        synchronously: the partitions are handed over after. ``step=False``: a shutdown drain's turn, whose
        poll() tracks nothing (never step over markers)."""
        self.last_commit = self.loop.clock.monotonic()
        if self.no_commit:
            return
        shutdown = self.loop.lifecycle.shutdown
        if shutdown is not None:
            # Stopping: no flush waits past the shutdown deadline (the pod's grace period is counted from it).
            flush_s = shutdown.cap(flush_s, 1.0)
        # The loop's periodic commit only: every message the consumer returned has been tracked by now. Inside
        # a rebalance callback, consume() may hold fetched messages it has not returned yet while the position
        # already counts them.
        periodic = step and not sync and only is None and self.loop.stop_at is None
        self._commit(only, sync, flush_s, periodic)

    def _commit(self, only: set[TopicPartition] | None, sync: bool, flush_s: float, periodic: bool) -> None:
        raise NotImplementedError

    def on_commit(self, err: Any, partitions: list[Any]) -> None:
        """librdkafka's report of a commit (served inside poll, on the loop thread)."""

    def stop_committing(self, reason: str) -> None:
        self.no_commit = True
        self.loop.lifecycle.fail(reason)
        log.error(reason)

    def step_over_markers(self, offsets: dict[TopicPartition, int]) -> None:
        """Where a partition has nothing unfinished, commit the consumer's position when it is past the
        tracker's offset. librdkafka moves the position over transaction markers (and aborted records), which
        never reach the worker: on input written by a transactional producer the commit otherwise stays one
        short of the end for good, a lag of 1 per partition that keeps KEDA from scaling to zero and an HPA
        from seeing an idle replica. Not in backfill (``stop_at``): records past its end are skipped untracked
        on purpose.

        A partition of which this assignment tracked nothing (a handover, a restart, a group whose commit sits
        on a marker) takes any valid position: librdkafka invalidates it on assign and seek (a rewind) and
        moves it only when it serves a message, which the loop has tracked by now, or a marker."""
        tracker, parts = self.tracker, self.loop.partitions
        idle = [tp for tp in parts.assigned if tracker.span(tp) == 0]
        if not idle:
            return
        try:
            positions = self.loop.consumer.position([KTP(tp.topic, tp.partition) for tp in idle])
        except KafkaException:
            return
        for k in positions:
            tp = TopicPartition(k.topic, k.partition)
            base = offsets.get(tp)
            if base is None:
                base = tracker.committed(tp)
            if base is None:
                # Nothing tracked: the position is valid only once a marker was served. Not again what this
                # worker committed last (the tracker keeps no commit for a partition it tracked nothing of).
                if k.offset >= 0 and k.offset != parts.last_commit(tp):
                    offsets[tp] = k.offset
            elif k.offset > base:
                offsets[tp] = k.offset


class AtLeastOnce(DeliveryMode):
    def __init__(self, loop: Loop, make_producer: MakeProducer, spare: bool = True) -> None:
        super().__init__(loop, make_producer)
        self._want_spare = spare  # see Emitter: a second producer takes over while the first one is stalled
        self.in_flight: dict[TopicPartition, int] | None = None  # an asynchronous commit not yet reported
        self._sent_at = 0.0

    def open(self) -> None:
        self.producer = self._make_producer(self.loop.cfg)
        if self._want_spare:
            self.spare_producer = self._make_producer(self.loop.cfg)

    def emitter_options(self) -> dict[str, Any]:
        cfg = self.loop.cfg
        return {"new_producer": lambda: self._make_producer(cfg)}

    def replace_consumer(self, consumer: Any) -> None:
        self.in_flight = None  # its report would come from the old consumer, which reports nothing now

    def track(self, part: Partition, offset: int) -> bool:
        if not self.tracker.track(part.tp, offset):
            # librdkafka moved the position back by itself (log truncation after an unclean leader election, a
            # topic deleted and recreated): the records at those offsets are new data.
            self._position_moved_back(part.tp, offset)
        return True

    def track_run(self, part: Partition, offsets: list[int]) -> Collection[int]:
        if self.tracker.track_run(part.tp, offsets):
            return ()
        return super().track_run(part, offsets)  # a position moved back: one at a time, each as above

    def _position_moved_back(self, tp: TopicPartition, offset: int) -> None:
        """A record at or below the last offset tracked on its partition, with no rebalance in between.
        Processed (it was skipped for a moment, losing new data); tracked afresh when nothing of the partition
        is unfinished, else untracked as before (its commit cannot wait for it)."""
        log.warning("consumer position moved back on %s[%d] to offset %d "
                    "(log truncated or topic recreated?): processing from there",
                    tp.topic, tp.partition, offset,
                    extra={"topic": tp.topic, "partition": tp.partition, "offset": offset})
        if self.tracker.pending(tp) == 0:
            self.tracker.assign([tp])
            self.tracker.track(tp, offset)

    def emit_ok(self, recs: list[Record], outs: list[Any], n: int, closed: float, infer_s: float, now: float,
                wall_ms: float) -> Iterable[int]:
        # The emitter's hot path: no Outcome per record; it declines what it cannot encode or send whole.
        return self.loop.emitter.emit_ok_many(recs, outs, n, closed, infer_s, now, wall_ms)

    def emit(self, outcome: Outcome, now: float, wall_ms: float) -> Iterable[Outcome]:
        return (self.loop.emitter.emit(outcome, now, wall_ms),)

    def settled(self, tp: TopicPartition, first_dropped: int | None) -> bool:
        oldest = self.tracker.first_pending(tp)
        return oldest is None or (first_dropped is not None and oldest >= first_dropped)

    def flush(self, seconds: float) -> None:
        self.loop.emitter.flush(seconds)

    def release(self, tps: set[TopicPartition], graceful: bool) -> None:
        if graceful:
            self.tracker.revoke(tps)
        else:
            # Lost (nothing could be committed): what this worker delivered of them is kept, and the results
            # still on their way go on marking records done, for when the partitions come back (Membership).
            self.tracker.detach(tps)

    def _commit(self, only: set[TopicPartition] | None, sync: bool, flush_s: float, periodic: bool) -> None:
        offsets = self.tracker.committable()
        if periodic:
            self.step_over_markers(offsets)
        if only is not None:
            offsets = {tp: o for tp, o in offsets.items() if tp in only}
        if not offsets:
            return
        if not sync and offsets == self.in_flight:
            return  # the same offsets are already on their way
        t0 = self.loop.clock.monotonic()
        try:
            self.loop.consumer.commit(offsets=[KTP(tp.topic, tp.partition, o) for tp, o in offsets.items()],
                                      asynchronous=not sync)
        except KafkaException as e:
            # A rebalance in progress or a fenced generation shows up here (asynchronously: only local errors,
            # e.g. not in a group any more); the new owner starts from the last successful commit.
            self._failed(e)
            return
        if sync:
            self._committed(offsets, t0)
        else:
            self.in_flight = offsets
            self._sent_at = t0

    def on_commit(self, err: Any, partitions: list[Any]) -> None:
        """It reports synchronous commits too; those were accounted for by ``_commit`` already."""
        if self.in_flight is None:
            return
        self.in_flight = None
        if err is not None:
            self._failed(err)
            return
        parts = self.loop.partitions
        done = {tp: k.offset for k in partitions if k.error is None and k.offset >= 0
                and parts.is_assigned(tp := TopicPartition(k.topic, k.partition))}
        if done:
            self._committed(done, self._sent_at)

    def _committed(self, offsets: dict[TopicPartition, int], sent_at: float) -> None:
        loop = self.loop
        self.tracker.mark_committed(offsets)
        loop.partitions.set_committed(offsets)
        loop.stats.commits += 1
        loop.broker_ok = True
        loop.metrics.gauge("commit_seconds", loop.clock.monotonic() - sent_at)

    def _failed(self, err: Any) -> None:
        # Not fatal: the same (or a later) prefix is committed next time.
        log.warning("commit failed: %s", err)
        self.loop.metrics.event("commit_failures")
