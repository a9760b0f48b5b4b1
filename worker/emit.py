"""Outcome -> records on the output topic and the dead-letter topic, with per-record delivery tracking.

A record is *done* only when everything it owes is delivered: its result (when its id is known) and its
dead letter (when it has one). Then ``on_done(record)`` fires; the runner acks its offset. A failed
delivery is retried ``max_retries`` times, then ``on_failed(record, error)`` fires (the runner stops without
committing past it, so the record is reprocessed after restart).

Delivery is confirmed by *settling*, not by a report per message: every message gets a callback, but only
a failure calls it (``delivery.report.only.error``); a record is done when the producer it was sent on
has nothing outstanding any more (``len(producer) == 0``: every message sent, acknowledged, and every
failure report served) and none of its messages failed. A success report per message cost the loop
thread 4-6 us per record (the client builds a Message object and calls into Python for each), about a
fifth of its time with a cheap model. To settle without stopping the loop while results keep flowing,
the emitter alternates between two producers: it sends on one while the other drains (``Emitter.settle``).

A producer that holds results undelivered for ``stall_s`` is replaced (``Emitter._replace``): librdkafka can
lose a partition's leader for good after the broker was briefly unreachable (confluentinc/librdkafka#5430: a
leader of -1 in a produce response leaves the partition without one, and its messages wait until they time
out, at every retry too). What it held is purged and sent again on a new producer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
from confluent_kafka import KafkaError, KafkaException

from schemas import DeadLetter, Result, Source, Timings
from worker.core.records import Outcome, Record

log = logging.getLogger("worker.emit")

_json = msgspec.json.Encoder()
_msgpack = msgspec.msgpack.Encoder()

# What a result's encoder may raise for an output it cannot write: an unsupported type (a tensor, a numpy
# scalar), an int beyond 64 bits (msgpack), nesting deeper than the encoder's recursion limit.
UNENCODABLE = (TypeError, ValueError, OverflowError, RecursionError, msgspec.EncodeError)

# librdkafka refuses a message when its largest possible size on the wire is over message.max.bytes
# (rd_kafka_msg_max_wire_size): key + value + headers + this much record overhead (varints at their widest).
RECORD_OVERHEAD = 36
ERROR_IN_RESULT = 200  # characters of the reason an error result keeps when the whole one makes it too big


def _varint_len(n: int) -> int:
    """Bytes of a length as a zigzag varint (how a record writes its header name and value lengths)."""
    v, size = n << 1, 1
    while v >= 0x80:
        v >>= 7
        size += 1
    return size


class FatalDeliveryError(RuntimeError):
    """The producer refuses a message outright (not a delivery that may succeed on retry): a topic that does
    not exist where the broker does not create topics, a fatal idempotence or transaction error. The worker
    stops; nothing past the record is committed, so it is processed again once the cause is fixed."""


_NO_TOPIC = (KafkaError._UNKNOWN_TOPIC, KafkaError.UNKNOWN_TOPIC_OR_PART)


# (topic, key, value, headers) of a message a record owes; the value of a tombstone's dead letter is None.
Message = tuple[str, bytes | None, bytes | None, list[tuple[str, bytes]] | None]

# The delivery report code of a message the broker refused for its size (librdkafka uses it for its own check too).
_TOO_LARGE = {KafkaError.MSG_SIZE_TOO_LARGE}


def describe(err: Any) -> str:
    """A producer error as an operator reads it, with what to do where that is known."""
    if not isinstance(err, KafkaError):
        return str(err)
    if err.code() in _NO_TOPIC:
        return (f"{err.str()} - the topic does not exist and the broker does not create topics on first use "
                "(auto.create.topics.enable): create it, or fix the name")
    return str(err.str())


class _Pending:
    """What one record owes (its result and/or dead letter). It is also the delivery callback of its first
    send round: one object per record instead of a closure per message."""

    __slots__ = ("record", "messages", "attempts", "round", "retry_at", "emitter")

    def __init__(self, record: Record, emitter: Emitter,
                 messages: list[Message] | None = None) -> None:
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
            self.emitter._failed(self, err, msg)


class _Retry:
    """The delivery callback of a retried round (rare), so late reports of the failed round are ignored."""

    __slots__ = ("p", "round")

    def __init__(self, p: _Pending) -> None:
        self.p = p
        self.round = p.round

    def __call__(self, err: Any, msg: Any) -> None:
        if err is not None and self.round == self.p.round:
            self.p.emitter._failed(self.p, err, msg)


class _Slot:
    """One producer, and the callbacks of the records sent on it since it last settled."""

    __slots__ = ("producer", "sent", "since")

    def __init__(self, producer: Any) -> None:
        self.producer = producer
        self.sent: list[_Pending | _Retry] = []
        self.since = 0.0  # monotonic time of the first of them


# Sending moves to the drained producer once the current one has held unconfirmed records this long: not at
# every loop turn, so that each producer still gets batches of a linger.ms (5 ms) worth of results.
SWITCH_AFTER_S = 0.005

# Replacements one after the other with nothing confirmed in between (a broker that is down, not a stuck
# producer) wait longer each time: the stall threshold doubles, up to this many times the configured one.
STALL_BACKOFF_MAX = 8

_PURGED = KafkaError(KafkaError._PURGE_QUEUE, "purged from a producer replaced after holding it for "
                                               "delivery.producer_stall_s")
_PURGE_CODES = (KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT)


def _live(cb: _Pending | _Retry) -> _Pending | None:
    """The record a slot entry stands for, while that entry is its record's current send round (a failure
    moved the record on to another round, whose entry is elsewhere)."""
    if isinstance(cb, _Pending):
        return cb if cb.round == 1 else None
    return cb.p if cb.round == cb.p.round else None


def _dispose(producer: Any) -> None:
    """Drops the last reference on this thread: librdkafka's destroy waits for its broker threads to stop."""
    del producer


class Emitter:
    def __init__(self, producer: Any, output_topic: str, dlq_topic: str, model_name: str, model_version: str | None,
                 fmt: str, on_done: Callable[[Record], None], on_failed: Callable[[Record, str], None],
                 max_retries: int = 5, is_stale: Callable[[Record], bool] | None = None,
                 max_message_bytes: int = 1_000_000, spare_producer: Any = None,
                 on_wait: Callable[[], None] | None = None, new_producer: Callable[[], Any] | None = None,
                 stall_s: float = 0.0, on_replace: Callable[[], None] | None = None) -> None:
        # With a spare, records are confirmed while results keep flowing: one producer takes new messages
        # while the other drains. Without one (the transactional producer, which flushes at every checkpoint
        # anyway), records are confirmed whenever the producer is idle or flushed.
        self.slots = [_Slot(producer)] + ([_Slot(spare_producer)] if spare_producer is not None else [])
        self.cur = self.slots[0]
        self.output_topic = output_topic
        self.dlq_topic = dlq_topic
        self.model_name = model_name
        self.model_version = model_version
        self.encode = _json.encode if fmt == "json" else _msgpack.encode
        self.on_done = on_done
        self.on_failed = on_failed
        self.max_retries = max_retries
        self.max_message_bytes = max_message_bytes  # the producer's message.max.bytes (librdkafka default)
        # A record whose partition was revoked (or whose transaction aborted) is not retried: the new
        # owner, or the rewound consumer, processes it again.
        self.is_stale = is_stale or (lambda _r: False)
        self.retry_queue: list[_Pending] = []
        # (partition, offset) -> topic of a record whose message the broker refused as too large (a topic's
        # max.message.bytes below this producer's message.max.bytes): sent again smaller, not as it was. In
        # exactly-once mode the refusal aborts the transaction and the record comes back through emit().
        self.too_large: dict[tuple[Any, int], str] = {}
        # Called while produce() waits for room in a full local queue (a slow or unreachable broker): that
        # wait is bounded by message.timeout.ms, and the loop is alive in it (the runner's liveness heartbeat).
        self.on_wait = on_wait
        # A producer holding results undelivered for stall_s is replaced by new_producer() (0 or no factory:
        # never; the transactional producer is not: an abort, and at worst a restart, covers it).
        self.new_producer = new_producer if stall_s > 0 else None
        self.stall_s = stall_s
        self._stall_after = stall_s
        # When a delivery last ended a time of replacements with nothing delivered (the broker is back): a slot
        # held since before then gets stall_s from then, time for its producer to reconnect.
        self._back_at = 0.0
        self.on_replace = on_replace
        self.replacements = 0
        self._purging = False  # serving the reports of a stalled producer's purge (_replace)
        self.produced = 0
        self.topic_keys = {output_topic: "kafka.output_topic", dlq_topic: "kafka.dlq_topic"}  # for messages

    @property
    def max_payload(self) -> int:
        """Key + value of a message without headers may be this long at most (see _size)."""
        return self.max_message_bytes - RECORD_OVERHEAD

    def _refused(self, topic: str, err: KafkaException) -> FatalDeliveryError:
        e = err.args[0] if err.args else err
        key = self.topic_keys.get(topic, "topic")
        return FatalDeliveryError(f"cannot produce to {topic!r} ({key}): {describe(e)}")

    def result_bytes(self, o: Outcome, now: float, now_wall_ms: float) -> bytes:
        rec = o.record
        t = o.timings
        return self._encode(rec, o.status, o.output, o.error, o.batch_size, t.get("queue", 0.0), t.get("infer", 0.0),
                            now, now_wall_ms, bool(t.get("cached")))

    def _encode(self, rec: Record, status: str, output: Any, error: str | None, batch_size: int, queue_s: float,
                infer_s: float, now: float, now_wall_ms: float, cached: bool = False) -> bytes:
        # Milliseconds with 3 decimals, truncated (int() is several times cheaper than round()), written out
        # rather than in a helper: this runs once per result, and a call per timing is a good part of its cost.
        produced = rec.produced_at_ms
        tp = rec.tp
        return self.encode(Result(
            id=rec.id or "",
            status=status,  # type: ignore[arg-type]
            outputs=output,
            error=error,
            model=self.model_name,
            model_version=self.model_version,
            lane=rec.lane,
            batch_size=batch_size,
            source=Source(topic=tp.topic, partition=tp.partition, offset=rec.offset),
            timings=Timings(queue_ms=int(queue_s * 1_000_000) / 1000.0, inference_ms=int(infer_s * 1_000_000) / 1000.0,
                            total_ms=int((now - rec.received_at) * 1_000_000) / 1000.0,
                            e2e_ms=int((now_wall_ms - produced) * 1000) / 1000.0 if produced else None),
            meta=rec.meta,
            cached=cached,
        ))

    def emit_ok_many(self, records: list[Record], outputs: list[Any], batch_size: int, closed_at: float,
                     infer_s: float, now: float, now_wall_ms: float) -> list[int]:
        """The hot path: one ok result per record of a batch, nothing else owed. Returns the indexes it did not
        send, for the general path: an output the encoder rejects, or a result over message.max.bytes.
        It is _send_result() unrolled into one loop per batch (one encode call and one produce per record):
        call frames are a good part of the per-record cost in CPython."""
        declined: list[int] = []
        encode, topic, limit = self._encode, self.output_topic, self.max_payload
        slot = self.cur
        produce, confirm_later = slot.producer.produce, slot.sent.append
        if not slot.sent:
            slot.since = now
        sent = 0
        for i, rec in enumerate(records):
            try:
                value = encode(rec, "ok", outputs[i], None, batch_size, closed_at - rec.received_at, infer_s, now,
                               now_wall_ms)
            except UNENCODABLE:
                declined.append(i)
                continue
            key = rec.key
            if len(value) + (len(key) if key else 0) > limit:
                declined.append(i)
                continue
            p = _Pending(rec, self, [(topic, key, value, None)])
            p.round = 1
            try:
                produce(topic, value, key, -1, p)  # positional: see _produce
                sent += 1
            except BufferError:
                self._produce(topic, key, value, None, p)  # waits for room; counts it
            except KafkaException as e:
                self.produced += sent
                raise self._refused(topic, e) from None
            confirm_later(p)
        self.produced += sent
        return declined

    def _send_result(self, rec: Record, value: bytes) -> bool:
        """Send ``value`` as the record's only message (a result, no dead letter). False, nothing sent, when it
        is over message.max.bytes: the general path turns that into an error result and a dead letter."""
        key = rec.key
        if len(value) + (len(key) if key else 0) > self.max_payload:  # _size() without headers
            return False
        p = _Pending(rec, self, [(self.output_topic, key, value, None)])
        self._send(p)
        return True

    def emit(self, o: Outcome, now: float, now_wall_ms: float, result_bytes: bytes | None = None) -> Outcome:
        """Send what the outcome owes. Returns the outcome as sent: an ok one whose output cannot be encoded, or
        whose result is over message.max.bytes, goes out as an ``error`` with an ``output`` dead letter (what the
        caller counts in its metrics)."""
        rec = o.record
        refused = self.too_large.get((rec.tp, rec.offset)) if self.too_large else None
        if refused is not None and (refused == self.output_topic or o.dlq_stage is not None):
            # (A refused dead letter matters only if the record owes one again: processed again, it may not.)
            return self._emit_smaller(o, refused, now, now_wall_ms)
        if o.dlq_stage is None and rec.id is not None and result_bytes is None:
            # Hot path: one result message, no dead letter.
            try:
                value = self.result_bytes(o, now, now_wall_ms)
            except UNENCODABLE:
                value = None  # handled below as an output error
            if value is not None and self._send_result(rec, value):
                return o
        p = _Pending(rec, self)
        if rec.id is not None:
            value = result_bytes
            if value is None:
                try:
                    value = self.result_bytes(o, now, now_wall_ms)
                except UNENCODABLE as e:
                    # An output the encoder rejects (a numpy scalar, a tensor...) is the record's error, not
                    # the worker's: raised here it would kill the loop and crash-loop on the record.
                    o = Outcome(rec, "error", error=f"result not encodable: {type(e).__name__}: {e}",
                                dlq_stage="output", batch_size=o.batch_size, timings=o.timings)
                    try:
                        value = self.result_bytes(o, now, now_wall_ms)
                    except UNENCODABLE:
                        # What cannot be written is the request's own meta (echoed in every result, nested
                        # just under the decoder's limit): the error result goes without it. Raised here, it
                        # ended the loop, at every restart.
                        rec.meta = None
                        value = self.result_bytes(o, now, now_wall_ms)
            if self._size(rec.key, value) > self.max_message_bytes:
                # produce() would raise MSG_SIZE_TOO_LARGE: an error result instead (if even that is too
                # big, e.g. a huge meta, the dead letter alone tells why).
                if o.dlq_stage is None:
                    with_key = f" with a key of {len(rec.key)} bytes" if rec.key else ""
                    o = Outcome(rec, "error", dlq_stage="output", batch_size=o.batch_size, timings=o.timings,
                                error=f"result of {len(value)} bytes{with_key} is over message.max.bytes="
                                      f"{self.max_message_bytes}")
                    value = self.result_bytes(o, now, now_wall_ms)
                elif o.error and len(o.error) > ERROR_IN_RESULT:
                    # An error result made too big by its reason (a model's exception text): the result says
                    # less, the dead letter keeps the reason and the stage.
                    cut = Outcome(rec, o.status, error=o.error[:ERROR_IN_RESULT] + " ... (cut; the dead letter has "
                                  "it all)", dlq_stage=o.dlq_stage, batch_size=o.batch_size, timings=o.timings)
                    value = self.result_bytes(cut, now, now_wall_ms)
            if self._size(rec.key, value) <= self.max_message_bytes:
                p.messages.append((self.output_topic, rec.key, value, None))
        if o.dlq_stage is not None:
            p.messages.append((self.dlq_topic, *self._dead_letter_message(rec, o.dlq_stage, o.error or o.dlq_stage)))
        if o.status != "ok":
            rec.failed = True  # o is the final outcome here (an unencodable or oversize ok became an error)
        if not p.messages:  # nothing owed (cannot happen with a DLQ stage set); done at once
            self.on_done(rec)
            return o
        self._send(p)
        return o

    def _dead_letter_message(self, rec: Record, stage: str, reason: str, refused: str | None = None
                             ) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
        """(key, value, headers) of the record's dead letter: its original bytes, key and headers (less stale
        ``x-*`` ones) and the reason. When the input topic took a record bigger than this producer may write,
        the original bytes are dropped; should it still not fit, the reason is cut to ``ERROR_IN_RESULT``
        characters, then the bigger of its headers and key is dropped, then the other, and the reason says what
        went. What is left (the ``x-*`` headers, a topic name of at most 249 characters) fits in librdkafka's
        smallest message.max.bytes, 1000. Else produce() raises, the worker stops, and the same record stops it
        again at every restart. ``refused``: the broker refused the whole dead letter (its reason): the
        original bytes are dropped whatever their size."""
        kept = [(k, v) for k, v in rec.headers if not k.startswith("x-error") and not k.startswith("x-source")
                and k != "x-attempts"]
        key, limit = rec.key, self.max_message_bytes
        headers = kept + self._dead_letter(rec, stage, reason).headers()
        if refused is None and self._size(key, rec.value, headers) <= limit:
            return key, rec.value, headers
        dropped = f"original value of {len(rec.value or b'')} bytes"
        why = refused or f"over message.max.bytes={limit}"

        def letter() -> list[tuple[str, bytes]]:
            return kept + self._dead_letter(rec, stage, f"{dropped} dropped ({why}): {reason}").headers()

        headers = letter()
        if self._size(key, b"", headers) > limit and len(reason) > ERROR_IN_RESULT:
            reason = reason[:ERROR_IN_RESULT] + " ... (cut)"
            headers = letter()
        kept_size = self._size(None, None, kept) - RECORD_OVERHEAD
        for part in sorted(("headers", "key"), key=lambda p: kept_size if p == "headers" else len(key or b""),
                           reverse=True):  # the bigger one first: the other may then stay
            if self._size(key, b"", headers) <= limit:
                break
            if part == "headers" and kept:
                dropped += f", its headers ({kept_size} bytes)"
                kept = []
            elif part == "key" and key:
                dropped += f", its key ({len(key)} bytes)"
                key = None
            headers = letter()
        return key, b"", headers

    @staticmethod
    def _dead_letter(rec: Record, stage: str, error: str) -> DeadLetter:
        return DeadLetter(error=error[:4000], error_stage=stage,  # type: ignore[arg-type]
                          source_topic=rec.tp.topic, source_partition=rec.tp.partition,
                          source_offset=rec.offset, attempts=max(rec.attempts, 1))

    @staticmethod
    def _size(key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]] | None = None) -> int:
        """What librdkafka compares with message.max.bytes: key + value + each header's name and value with
        their varint lengths + the record overhead."""
        size = RECORD_OVERHEAD + len(key or b"") + len(value or b"")
        for k, v in headers or ():
            name = len(k.encode())
            size += _varint_len(name) + name + _varint_len(len(v or b"")) + len(v or b"")
        return size

    def _send(self, p: _Pending) -> None:
        p.round += 1
        cb = p if p.round == 1 else _Retry(p)
        slot = self.cur  # all of a record's messages go on one producer: its settling confirms them together
        for topic, key, value, headers in p.messages:
            self._produce(topic, key, value, headers, cb)
        if not slot.sent:
            slot.since = time.monotonic()
        slot.sent.append(cb)

    def _produce(self, topic: str, key: bytes | None, value: bytes | None, headers: Any, cb: Any) -> None:
        while True:
            try:
                if headers is None:
                    # Positional (topic, value, key, partition, callback): confluent-kafka parses keyword
                    # arguments at about twice the cost, ~0.8 us per message. -1 is RD_KAFKA_PARTITION_UA, its
                    # default: the partitioner picks from the key.
                    self.cur.producer.produce(topic, value, key, -1, cb)
                else:
                    self.cur.producer.produce(topic, value=value, key=key, headers=headers, on_delivery=cb)
                self.produced += 1
                return
            except BufferError:
                # Local queue full: serve failure reports, then try again (the messages ahead are delivered or
                # time out within message.timeout.ms).
                if self.on_wait is not None:
                    self.on_wait()
                self.cur.producer.poll(0.05)
            except KafkaException as e:
                raise self._refused(topic, e) from None

    def _failed(self, p: _Pending, err: Any, msg: Any = None) -> None:
        p.attempts += 1
        rec = p.record
        # A purge is the worker's own doing (an abort, a producer replaced), logged once where it is decided.
        quiet = isinstance(err, KafkaError) and err.code() in _PURGE_CODES
        if quiet and self._purging:
            err = _PURGED  # librdkafka's "Local: Purged in queue" does not say why
        (log.debug if quiet else log.warning)("delivery failed (attempt %d): %s", p.attempts, err,
                                              extra={"id": rec.id, "topic": rec.tp.topic, "offset": rec.offset})
        if (isinstance(err, KafkaError) and err.code() in _TOO_LARGE and msg is not None
                and (rec.tp, rec.offset) not in self.too_large):
            # The topic takes smaller messages than this producer may write: the same bytes would be refused at
            # every retry, and at every restart. Sent again as an error result and a dead letter without the
            # original bytes (exactly-once: after the abort, through emit()).
            self.too_large[(rec.tp, rec.offset)] = topic = msg.topic()
            if self.max_retries > 0:
                p.messages = self._smaller_messages(p, topic, describe(err))
                rec.failed = True
                p.retry_at = 0.0
                self.retry_queue.append(p)
                p.round += 1
                return
        if p.attempts <= self.max_retries:
            # Re-send everything this record owes; duplicates of the part that did arrive are allowed
            # by at-least-once and absorbed by the idempotent producer per message otherwise.
            p.retry_at = time.monotonic() + min(0.05 * p.attempts, 0.5)
            self.retry_queue.append(p)
        else:
            self.on_failed(p.record, describe(err))
        p.round += 1  # the round failed: its other reports are ignored, and settling does not confirm it

    def _smaller_messages(self, p: _Pending, topic: str, why: str) -> list[Message]:
        """The record's messages after the broker refused the one for ``topic`` as too large: a refused result
        becomes an ``error`` result with an ``output`` dead letter (or, for a record that owes a dead letter
        already, goes: the dead letter says why); a refused dead letter goes without the original bytes."""
        rec = p.record
        out: list[Message] = []
        dead = next((m for m in p.messages if m[0] == self.dlq_topic), None)
        result = next((m for m in p.messages if m[0] == self.output_topic), None)
        refused = f"refused by the broker: {why}"
        if topic == self.dlq_topic and dead is not None:
            dl = DeadLetter.from_headers(dead[3])
            if result is not None:
                out.append(result)
            out.append((self.dlq_topic, *self._dead_letter_message(rec, dl.error_stage, dl.error, refused)))
        elif dead is not None:
            out.append(dead)
        else:
            error = f"result of {len(result[2] or b'') if result is not None else 0} bytes {refused}"
            rec.meta = None
            value = self._encode(rec, "error", None, error, 0, 0.0, 0.0, time.monotonic(), time.time() * 1000.0)
            out.append((self.output_topic, rec.key, value, None))
            out.append((self.dlq_topic, *self._dead_letter_message(rec, "output", error)))
        return out

    def _emit_smaller(self, o: Outcome, topic: str, now: float, now_wall_ms: float) -> Outcome:
        """emit() for a record whose message the broker refused as too large before (exactly-once: the
        transaction was aborted, and the record processed again): what ``_smaller_messages`` sends."""
        rec = o.record
        refused = "refused by the broker: Message size too large"
        owed_dead_letter = o.dlq_stage is not None
        if topic == self.output_topic and not owed_dead_letter:
            rec.meta = None
            o = Outcome(rec, "error", error=f"result {refused}", dlq_stage="output", batch_size=o.batch_size,
                        timings=o.timings)
        p = _Pending(rec, self)
        if rec.id is not None and not (topic == self.output_topic and owed_dead_letter):
            p.messages.append((self.output_topic, rec.key, self.result_bytes(o, now, now_wall_ms), None))
        stage = o.dlq_stage or "output"  # (always set here: see emit())
        p.messages.append((self.dlq_topic, *self._dead_letter_message(
            rec, stage, o.error or stage, refused if topic == self.dlq_topic else None)))
        rec.failed = True
        self._send(p)
        return o

    # ------------------------------------------------------------------ settling
    def poll(self, timeout: float = 0.0) -> None:
        """Serve the producers' failure reports (the callbacks run here, on the calling thread)."""
        for slot in self.slots:
            slot.producer.poll(timeout / len(self.slots))

    def settle(self, now: float) -> None:
        """Never blocks. Confirms the records of every producer with nothing outstanding, then moves sending to
        a producer that has nothing left to confirm, so that the current one can drain."""
        for slot in self.slots:
            # len(): messages not yet acknowledged plus reports not yet served. At 0, every message sent on it
            # so far is on the broker or its failure was reported.
            if slot.sent and len(slot.producer) == 0:
                self._confirm(slot)
            elif (slot.sent and self.new_producer is not None
                  and now - max(slot.since, self._back_at) >= self._stall_after):
                self._replace(slot, now)
        cur = self.cur
        if cur.sent and now - cur.since >= SWITCH_AFTER_S:
            for slot in self.slots:
                if not slot.sent:
                    self.cur = slot
                    break

    def flush(self, timeout: float) -> int:
        """Wait up to ``timeout`` for every producer to drain; confirm what drained. Returns the number of
        messages (and reports) still outstanding."""
        deadline = time.monotonic() + timeout
        left = 0
        for slot in self.slots:
            n = slot.producer.flush(max(0.0, deadline - time.monotonic()))
            if n == 0 and slot.sent:
                self._confirm(slot)
            left += n
        return left

    def _replace(self, slot: _Slot, now: float) -> None:
        """``slot``'s producer has held records unconfirmed for ``stall_s``: a slot drains within a broker round
        trip once sending moves off it, so it is stuck (a partition left without a leader) or the broker is
        down. What it holds is purged, the failures go the usual way (a retry, with backoff, on the current
        producer; each purge is one of a record's attempts), and a new producer takes the slot. The old one is
        dropped on a thread of its own, never polled again: a report it still serves is of a round that is over."""
        old, after, delivered = slot.producer, self._stall_after, 0
        log.error("a producer has held the results of %d records undelivered for %.0f s (delivery.producer_stall_s="
                  "%g): replacing it and sending them again on a new one", len(slot.sent), now - slot.since,
                  self.stall_s)
        self._purging = True  # its reports say "Local: Purged in queue"; the records' failures say why
        try:
            old.purge(in_queue=True, in_flight=True)
            old.poll(0)  # the purge reports: each purged record fails (and is retried) through _failed
        except Exception:
            log.exception("purging the stalled producer")
        finally:
            self._purging = False
        if len(old) == 0:
            delivered = self._confirm(slot)  # the records whose messages were all acknowledged before the purge
        for cb in slot.sent:  # anything still unsettled fails now; its late reports are of an earlier round
            p = _live(cb)
            if p is not None:
                self._failed(p, _PURGED)
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

    @property
    def unconfirmed(self) -> int:
        return sum(len(slot.sent) for slot in self.slots)

    def _confirm(self, slot: _Slot) -> int:
        """Every record of ``slot`` whose current round went on it is done; returns how many."""
        sent, slot.sent = slot.sent, []
        on_done = self.on_done
        # A record the broker refused as too large, now delivered smaller: forgotten. (An entry whose partition
        # went elsewhere before that stays: one per such refusal, rare.)
        forget = self.too_large
        n = 0
        for cb in sent:
            # A failure bumped its record's round, so the entry of a failed round no longer matches; the
            # re-sent round is an entry of its own, confirmed with the producer it went on. (_live, inlined:
            # this runs once per record.)
            if isinstance(cb, _Pending):
                if cb.round == 1:
                    on_done(cb.record)
                    n += 1
                    if forget:
                        forget.pop((cb.record.tp, cb.record.offset), None)
            elif cb.round == cb.p.round:
                on_done(cb.p.record)
                n += 1
                if forget:
                    forget.pop((cb.p.record.tp, cb.p.record.offset), None)
        if n and self._stall_after != self.stall_s:
            # Delivered after replacements that delivered nothing: the broker is back, and a stall is a
            # producer's again.
            self._stall_after = self.stall_s
            self._back_at = time.monotonic()
        return n

    def retry_failed(self) -> None:
        """Re-send the failed records whose backoff has passed. Never sleeps: it runs on the loop thread,
        and an outage fails every in-flight delivery at once."""
        if not self.retry_queue:
            return
        now = time.monotonic()
        queue, self.retry_queue = self.retry_queue, []
        for p in queue:
            if self.is_stale(p.record):
                continue
            if p.retry_at > now:
                self.retry_queue.append(p)
                continue
            self._send(p)
