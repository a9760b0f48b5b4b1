"""Which sent records are delivered: settling two producers in turn, and replacing a stalled one.

Delivery is confirmed by *settling*, not by a report per message: every message gets a callback, but only
a failure calls it (``delivery.report.only.error``); a record is done when the producer it was sent on
has nothing outstanding any more (``len(producer) == 0``: every message sent, acknowledged, and every
failure report served) and none of its messages failed. To settle without stopping the loop while results
keep flowing, sending alternates between two producers: one takes new messages while the other drains.

A slot lists what was sent on it since it last settled: one ``SentBatch`` per batch of ok results (the
callback of all its messages, so that a batch costs one entry and one callback object), one ``Pending``
per record sent alone, one ``Retry`` per re-sent round.

A producer that holds results undelivered for ``stall_s`` is replaced (``Settling.replace``): librdkafka can
lose a partition's leader for good after the broker was briefly unreachable (confluentinc/librdkafka#5430: a
leader of -1 in a produce response leaves the partition without one, and its messages wait until they time
out, at every retry too). What it held is purged and sent again on a new producer.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

from confluent_kafka import KafkaError

from worker.core.records import Record

log = logging.getLogger("worker.emit")

# (topic, key, value, headers) of a message a record owes; the value of a tombstone's dead letter is None.
Message = tuple[str, bytes | None, bytes | None, list[tuple[str, bytes]] | None]

# Sending moves to the drained producer once the current one has held unconfirmed records this long: not at
# every loop turn, so that each producer still gets batches of a linger.ms (5 ms) worth of results.
SWITCH_AFTER_S = 0.005

# Replacements one after the other with nothing confirmed in between (a broker that is down, not a stuck
# producer) wait longer each time: the stall threshold doubles, up to this many times the configured one.
STALL_BACKOFF_MAX = 8

PURGED = KafkaError(KafkaError._PURGE_QUEUE, "purged from a producer replaced after holding it for "
                                              "delivery.producer_stall_s")


class Owner(Protocol):
    def delivery_failed(self, p: Pending, err: Any, msg: Any = None) -> None: ...


class Pending:
    """What one record owes (its result and/or dead letter). It is also the delivery callback of its first
    send round: one object per record instead of a closure per message."""

    __slots__ = ("record", "messages", "attempts", "round", "retry_at", "emitter")

    def __init__(self, record: Record, emitter: Owner, messages: list[Message] | None = None) -> None:
        self.record = record
        self.emitter = emitter
        self.messages = messages if messages is not None else []
        self.attempts = 0
        self.round = 0  # callbacks of an earlier (failed) round are ignored
        self.retry_at = 0.0  # monotonic time before which a failed record is not re-sent (backoff)

    def __call__(self, err: Any, msg: Any) -> None:
        # Only a failure matters (a success report, if the producer is set to send them, changes nothing:
        # the record is confirmed when its producer has settled).
        if err is not None and self.round == 1:
            self.emitter.delivery_failed(self, err, msg)


class Retry:
    """The delivery callback of a retried round (rare), so late reports of the failed round are ignored."""

    __slots__ = ("p", "round")

    def __init__(self, p: Pending) -> None:
        self.p = p
        self.round = p.round

    def __call__(self, err: Any, msg: Any) -> None:
        if err is not None and self.round == self.p.round:
            self.p.emitter.delivery_failed(self.p, err, msg)


class SentBatch:
    """The ok results of one batch, one message each on ``topic``, sent in one round: the delivery callback
    of all of them. A failure report names its message; the record is found by the message's value (each
    result names its source offset, so the values of a batch differ), leaves the batch and goes on alone as
    a ``Pending``."""

    __slots__ = ("records", "values", "topic", "emitter", "failed", "_index")

    def __init__(self, records: list[Record], values: list[bytes], topic: str, emitter: Owner) -> None:
        self.records = records
        self.values = values
        self.topic = topic
        self.emitter = emitter
        self.failed: set[int] = set()  # indexes of the records that left the batch
        self._index: dict[bytes, int] | None = None

    def __call__(self, err: Any, msg: Any) -> None:
        if err is None:
            return
        if self._index is None or len(self._index) < len(self.values):  # (values grow while it sends)
            self._index = {v: i for i, v in enumerate(self.values)}
        i = self._index.get(msg.value()) if msg is not None else None
        if i is None:  # a report that names no message of the batch: every record still in it failed
            for j in range(len(self.records)):
                self.fail(j, err, msg)
        else:
            self.fail(i, err, msg)

    def fail(self, i: int, err: Any, msg: Any) -> None:
        if i in self.failed:
            return
        self.failed.add(i)
        rec = self.records[i]
        p = Pending(rec, self.emitter, [(self.topic, rec.key, self.values[i], None)])
        p.round = 1
        self.emitter.delivery_failed(p, err, msg)

    def live(self) -> list[int]:
        return [i for i in range(len(self.records)) if i not in self.failed]


Sent = Pending | Retry | SentBatch


def live(cb: Pending | Retry) -> Pending | None:
    """The record a slot entry stands for, while that entry is its record's current send round (a failure
    moved the record on to another round, whose entry is elsewhere)."""
    if isinstance(cb, Pending):
        return cb if cb.round == 1 else None
    return cb.p if cb.round == cb.p.round else None


class Slot:
    """One producer, and the callbacks of the records sent on it since it last settled."""

    __slots__ = ("producer", "sent", "since")

    def __init__(self, producer: Any) -> None:
        self.producer = producer
        self.sent: list[Sent] = []
        self.since = 0.0  # monotonic time of the first of them


def _dispose(producer: Any) -> None:
    """Drops the last reference on this thread: librdkafka's destroy waits for its broker threads to stop."""
    del producer


class Settling:
    """The emitter's producers, and which of its records they have delivered. ``clock`` is monotonic time;
    ``on_done(record)`` fires for each delivered record (``on_done_many(records)`` for those of a batch, when
    given); ``fail(pending, error)`` for each one a replaced producer held."""

    def __init__(self, producer: Any, spare_producer: Any, *, clock: Callable[[], float],
                 on_done: Callable[[Record], None], fail: Callable[[Pending, Any], None],
                 new_producer: Callable[[], Any] | None, stall_s: float,
                 on_replace: Callable[[], None] | None = None, forget: dict[Any, str] | None = None,
                 on_done_many: Callable[[list[Record]], None] | None = None) -> None:
        # With a spare, records are confirmed while results keep flowing: one producer takes new messages
        # while the other drains. Without one (the transactional producer, which flushes at every checkpoint
        # anyway), records are confirmed whenever the producer is idle or flushed.
        self.slots = [Slot(producer)] + ([Slot(spare_producer)] if spare_producer is not None else [])
        self.cur = self.slots[0]
        self.clock = clock
        self.on_done = on_done
        self.on_done_many = on_done_many
        self.fail = fail
        # A producer holding results undelivered for stall_s is replaced by new_producer() (0 or no factory:
        # never; the transactional producer is not: an abort, and at worst a restart, covers it).
        self.new_producer = new_producer if stall_s > 0 else None
        self.stall_s = stall_s
        self._stall_after = stall_s
        # When a delivery last ended a time of replacements with nothing delivered (the broker is back): a
        # slot held since before then gets stall_s from then, time for its producer to reconnect.
        self._back_at = 0.0
        self.on_replace = on_replace
        self.replacements = 0
        self.purging = False  # serving the reports of a stalled producer's purge (replace)
        # (partition, offset) -> topic of records the broker refused as too large: forgotten once delivered.
        self.too_large: dict[Any, str] = forget if forget is not None else {}

    def poll(self, timeout: float = 0.0) -> None:
        """Serve the producers' failure reports (the callbacks run here, on the calling thread)."""
        for slot in self.slots:
            slot.producer.poll(timeout / len(self.slots))

    def settle(self, now: float) -> None:
        """Never blocks. Confirms the records of every producer with nothing outstanding, then moves sending
        to a producer that has nothing left to confirm, so that the current one can drain."""
        for slot in self.slots:
            # len(): messages not yet acknowledged plus reports not yet served. At 0, every message sent on it
            # so far is on the broker or its failure was reported.
            if slot.sent and len(slot.producer) == 0:
                self.confirm(slot)
            elif (slot.sent and self.new_producer is not None
                  and now - max(slot.since, self._back_at) >= self._stall_after):
                self.replace(slot, now)
        cur = self.cur
        if cur.sent and now - cur.since >= SWITCH_AFTER_S:
            for slot in self.slots:
                if not slot.sent:
                    self.cur = slot
                    break

    def flush(self, timeout: float) -> int:
        """Wait up to ``timeout`` for every producer to drain; confirm what drained. Returns the number of
        messages (and reports) still outstanding."""
        deadline = self.clock() + timeout
        left = 0
        for slot in self.slots:
            n = slot.producer.flush(max(0.0, deadline - self.clock()))
            if n == 0 and slot.sent:
                self.confirm(slot)
            left += n
        return left

    def replace(self, slot: Slot, now: float) -> None:
        """``slot``'s producer has held records unconfirmed for ``stall_s``: a slot drains within a broker
        round trip once sending moves off it, so it is stuck (a partition left without a leader) or the broker
        is down. What it holds is purged, the failures go the usual way (a retry, with backoff, on the current
        producer; each purge is one of a record's attempts), and a new producer takes the slot. The old one
        is dropped on a thread of its own, never polled again: a report it still serves is of a round that is
        over."""
        old, after, delivered = slot.producer, self._stall_after, 0
        log.error("a producer has held the results of %d records undelivered for %.0f s "
                  "(delivery.producer_stall_s=%g): replacing it and sending them again on a new one",
                  self.count(slot), now - slot.since, self.stall_s)
        self.purging = True  # its reports say "Local: Purged in queue"; the records' failures say why
        try:
            old.purge(in_queue=True, in_flight=True)
            old.poll(0)  # the purge reports: each purged record fails (and is retried) through fail
        except Exception:
            log.exception("purging the stalled producer")
        finally:
            self.purging = False
        if len(old) == 0:
            delivered = self.confirm(slot)  # the records whose messages were acknowledged before the purge
        for cb in slot.sent:  # anything still unsettled fails now; its late reports are of an earlier round
            if isinstance(cb, SentBatch):
                for i in cb.live():
                    cb.fail(i, PURGED, None)
                continue
            p = live(cb)
            if p is not None:
                self.fail(p, PURGED)
        slot.sent = []
        # Something it held was delivered: the broker is up and this producer was stuck; the next one gets the
        # same time. Nothing was: maybe the broker is down, and the next replacement waits twice as long.
        if not delivered:
            self._stall_after = min(after * 2, self.stall_s * STALL_BACKOFF_MAX)
        assert self.new_producer is not None  # settle() replaces only with a factory
        try:
            slot.producer = self.new_producer()
        except Exception:
            log.exception("making a producer to replace the stalled one: the old one is kept")
            return
        self.replacements += 1
        if self.on_replace is not None:
            self.on_replace()
        threading.Thread(target=_dispose, args=(old,), name="kiw-producer-dispose", daemon=True).start()

    @staticmethod
    def count(slot: Slot) -> int:
        """Records sent on ``slot`` since it last settled."""
        return sum(len(cb.records) if isinstance(cb, SentBatch) else 1 for cb in slot.sent)

    @property
    def unconfirmed(self) -> int:
        return sum(self.count(slot) for slot in self.slots)

    def confirm(self, slot: Slot) -> int:
        """Every record of ``slot`` whose current round went on it is done; returns how many."""
        sent, slot.sent = slot.sent, []
        on_done, on_done_many = self.on_done, self.on_done_many
        # A record the broker refused as too large, now delivered smaller: forgotten. (An entry whose
        # partition went elsewhere before that stays: one per such refusal, rare.)
        forget = self.too_large
        n = 0
        for cb in sent:
            # A failure bumped its record's round (or took it out of its batch), so the entry of a failed
            # round no longer matches; the re-sent round is an entry of its own, confirmed with the producer
            # it went on.
            if isinstance(cb, SentBatch):
                recs = cb.records if not cb.failed else [cb.records[i] for i in cb.live()]
                if on_done_many is not None:
                    on_done_many(recs)
                else:
                    for rec in recs:
                        on_done(rec)
                n += len(recs)
                if forget:
                    for rec in recs:
                        forget.pop((rec.tp, rec.offset), None)
                continue
            p = live(cb)
            if p is not None:
                on_done(p.record)
                n += 1
                if forget:
                    forget.pop((p.record.tp, p.record.offset), None)
        if n and self._stall_after != self.stall_s:
            # Delivered after replacements that delivered nothing: the broker is back, and a stall is a
            # producer's again.
            self._stall_after = self.stall_s
            self._back_at = self.clock()
        return n
