"""Outcome -> records on the output topic and the dead-letter topic, with per-record delivery tracking.

A record is *done* only when everything it owes is delivered: its result (when its id is known) and its
dead letter (when it has one). Then ``on_done(record)`` fires; the runner acks its offset. A failed
delivery is retried ``max_retries`` times, then ``on_failed(record, error)`` fires (the runner stops without
committing past it, so the record is reprocessed after restart). Which sent records are delivered is
``settling.py``'s; what a result and a dead letter hold is ``result_encoding.py``'s and ``dead_letters.py``'s.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException

from schemas import DeadLetter
from worker.core.records import Outcome, Record
from worker.output.dead_letters import ERROR_IN_RESULT, RECORD_OVERHEAD, dead_letter_message, message_size
from worker.output.result_encoding import UNENCODABLE, OutputsEncoding, ResultEncoder
from worker.output.settling import PURGED, Message, Pending, Retry, SentBatch, Settling, Slot
from worker.timing.clock import LoopClock

log = logging.getLogger("worker.emit")


class FatalDeliveryError(RuntimeError):
    """The producer refuses a message outright (not a delivery that may succeed on retry): a topic that does
    not exist where the broker does not create topics, a fatal idempotence or transaction error. The worker
    stops; nothing past the record is committed, so it is processed again once the cause is fixed."""


_NO_TOPIC = (KafkaError._UNKNOWN_TOPIC, KafkaError.UNKNOWN_TOPIC_OR_PART)
# The delivery report code of a message the broker refused for its size (librdkafka uses it for its own
# check too).
_TOO_LARGE = {KafkaError.MSG_SIZE_TOO_LARGE}
_PURGE_CODES = (KafkaError._PURGE_QUEUE, KafkaError._PURGE_INFLIGHT)


def describe(err: Any) -> str:
    """A producer error as an operator reads it, with what to do where that is known."""
    if not isinstance(err, KafkaError):
        return str(err)
    if err.code() in _NO_TOPIC:
        return (f"{err.str()} - the topic does not exist and the broker does not create topics on first use "
                "(auto.create.topics.enable): create it, or fix the name")
    return str(err.str())


class Emitter:
    def __init__(self, producer: Any, output_topic: str, dlq_topic: str, model_name: str,
                 model_version: str | None, fmt: str, on_done: Callable[[Record], None],
                 on_failed: Callable[[Record, str], None],
                 max_retries: int = 5, is_stale: Callable[[Record], bool] | None = None,
                 max_message_bytes: int = 1_000_000, spare_producer: Any = None,
                 on_wait: Callable[[], None] | None = None, new_producer: Callable[[], Any] | None = None,
                 stall_s: float = 0.0, on_replace: Callable[[], None] | None = None,
                 outputs_encoding: OutputsEncoding = "lists",
                 on_done_many: Callable[[list[Record]], None] | None = None,
                 clock: LoopClock = time) -> None:
        self.clock = clock  # monotonic() for backoffs and stalls, time() for result timestamps
        self.output_topic = output_topic
        self.dlq_topic = dlq_topic
        self.results = ResultEncoder(model_name, model_version, fmt, outputs_encoding)
        self.on_done = on_done
        self.on_failed = on_failed
        self.max_retries = max_retries
        self.max_message_bytes = max_message_bytes  # the producer's message.max.bytes (librdkafka default)
        # A record whose partition was revoked (or whose transaction aborted) is not retried: the new
        # owner, or the rewound consumer, processes it again.
        self.is_stale = is_stale or (lambda _r: False)
        self.retry_queue: list[Pending] = []
        # (partition, offset) -> topic of a record whose message the broker refused as too large (a topic's
        # max.message.bytes below this producer's message.max.bytes): sent again smaller, not as it was. In
        # exactly-once mode the refusal aborts the transaction and the record comes back through emit().
        self.too_large: dict[tuple[Any, int], str] = {}
        # Called while produce() waits for room in a full local queue (a slow or unreachable broker): that
        # wait is bounded by message.timeout.ms, and the loop is alive in it (the runner's liveness
        # heartbeat).
        self.on_wait = on_wait
        self.settling = Settling(producer, spare_producer, clock=clock.monotonic, on_done=on_done,
                                 fail=self.delivery_failed, new_producer=new_producer, stall_s=stall_s,
                                 on_replace=on_replace, forget=self.too_large, on_done_many=on_done_many)
        self.produced = 0
        self.topic_keys = {output_topic: "kafka.output_topic", dlq_topic: "kafka.dlq_topic"}  # for messages

    # ---- the producers (settling.py)
    @property
    def slots(self) -> list[Slot]:
        return self.settling.slots

    @property
    def cur(self) -> Slot:
        return self.settling.cur

    @property
    def replacements(self) -> int:
        return self.settling.replacements

    @property
    def new_producer(self) -> Callable[[], Any] | None:
        return self.settling.new_producer

    @property
    def unconfirmed(self) -> int:
        return self.settling.unconfirmed

    def poll(self, timeout: float = 0.0) -> None:
        """Serve the producers' failure reports (the callbacks run here, on the calling thread)."""
        self.settling.poll(timeout)

    def settle(self, now: float) -> None:
        """Never blocks: confirms what the producers delivered (see ``Settling.settle``)."""
        self.settling.settle(now)

    def flush(self, timeout: float) -> int:
        """Wait up to ``timeout`` for every producer to drain; confirm what drained. Returns the number of
        messages (and reports) still outstanding."""
        return self.settling.flush(timeout)

    # ---- sending
    @property
    def max_payload(self) -> int:
        """Key + value of a message without headers may be this long at most (see message_size)."""
        return self.max_message_bytes - RECORD_OVERHEAD

    def _refused(self, topic: str, err: KafkaException) -> FatalDeliveryError:
        e = err.args[0] if err.args else err
        key = self.topic_keys.get(topic, "topic")
        return FatalDeliveryError(f"cannot produce to {topic!r} ({key}): {describe(e)}")

    def result_bytes(self, o: Outcome, now: float, now_wall_ms: float) -> bytes:
        t = o.timings
        return self.results.encode(o.record, o.status, o.output, o.error, o.batch_size, t.get("queue", 0.0),
                                   t.get("infer", 0.0), now, now_wall_ms, bool(t.get("cached")))

    def emit_ok_many(self, records: list[Record], outputs: list[Any], batch_size: int, closed_at: float,
                     infer_s: float, now: float, now_wall_ms: float) -> list[int]:
        """The hot path: one ok result per record of a batch, nothing else owed. Returns the indexes it did
        not send, for the general path: an output the encoder rejects, or a result over message.max.bytes.
        The results are encoded in one call over the batch; the sent ones share one slot entry and one
        delivery callback (``SentBatch``); one produce per record is what is left per record."""
        if not records:
            return []
        values = self.results.encode_ok(records, outputs, batch_size, closed_at, infer_s, now, now_wall_ms)
        topic, limit = self.output_topic, self.max_payload
        keys = [r.key for r in records]
        declined: list[int] = []
        # (map(len) only where no key is None: a generator per record costs more)
        longest_key = (max(len(k) if k else 0 for k in keys) if None in keys
                       else max(map(len, keys)))  # type: ignore[arg-type]
        if None in values or max(map(len, values)) + longest_key > limit:  # type: ignore[arg-type]
            # Some cannot go as they are (rare): the general path takes them.
            keep = [i for i, (v, k) in enumerate(zip(values, keys, strict=True))
                    if v is not None and len(v) + (len(k) if k else 0) <= limit]
            declined = sorted(set(range(len(values))) - set(keep))
            records = [records[i] for i in keep]
            values = [values[i] for i in keep]
            keys = [keys[i] for i in keep]
        if not records:
            return declined
        sent_values: list[bytes] = values  # type: ignore[assignment]
        batch = SentBatch(records, sent_values, topic, self)
        slot = self.cur
        produce = slot.producer.produce
        sent = 0
        try:
            for value, key in zip(sent_values, keys, strict=True):
                try:
                    # Positional (topic, value, key, partition, callback): see _produce.
                    produce(topic, value, key, -1, batch)
                except BufferError:
                    self._produce(topic, key, value, None, batch)  # waits for room; counts it
                    self.produced -= 1  # (counted below with the others)
                sent += 1
        except KafkaException as e:
            raise self._refused(topic, e) from None
        finally:
            self.produced += sent
            if sent:
                if sent < len(records):  # refused part way: what was not sent is not the batch's
                    batch.records, batch.values = records[:sent], sent_values[:sent]
                if not slot.sent:
                    slot.since = now
                slot.sent.append(batch)
        return declined

    def _send_result(self, rec: Record, value: bytes) -> bool:
        """Send ``value`` as the record's only message (a result, no dead letter). False, nothing sent, when
        it is over message.max.bytes: the general path turns that into an error result and a dead letter."""
        key = rec.key
        if len(value) + (len(key) if key else 0) > self.max_payload:  # message_size() without headers
            return False
        p = Pending(rec, self, [(self.output_topic, key, value, None)])
        self._send(p)
        return True

    def emit(self, o: Outcome, now: float, now_wall_ms: float, result_bytes: bytes | None = None) -> Outcome:
        """Send what the outcome owes. Returns the outcome as sent: an ok one whose output cannot be encoded,
        or whose result is over message.max.bytes, goes out as an ``error`` with an ``output`` dead letter
        (what the caller counts in its metrics)."""
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
        p = Pending(rec, self)
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
                    cut = Outcome(rec, o.status, dlq_stage=o.dlq_stage, batch_size=o.batch_size,
                                  timings=o.timings,
                                  error=o.error[:ERROR_IN_RESULT] + " ... (cut; the dead letter has it all)")
                    value = self.result_bytes(cut, now, now_wall_ms)
            if self._size(rec.key, value) <= self.max_message_bytes:
                p.messages.append((self.output_topic, rec.key, value, None))
        if o.dlq_stage is not None:
            p.messages.append((self.dlq_topic,
                               *self._dead_letter_message(rec, o.dlq_stage, o.error or o.dlq_stage)))
        if o.status != "ok":
            rec.failed = True  # o is the final outcome here (an unencodable or oversize ok became an error)
        if not p.messages:  # nothing owed (cannot happen with a DLQ stage set); done at once
            self.on_done(rec)
            return o
        self._send(p)
        return o

    def _dead_letter_message(self, rec: Record, stage: str, reason: str, refused: str | None = None
                             ) -> tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]:
        return dead_letter_message(rec, stage, reason, self.max_message_bytes, refused)

    @staticmethod
    def _size(key: bytes | None, value: bytes | None, headers: list[tuple[str, bytes]] | None = None) -> int:
        return message_size(key, value, headers)

    def _send(self, p: Pending) -> None:
        p.round += 1
        cb = p if p.round == 1 else Retry(p)
        slot = self.cur  # all of a record's messages go on one producer: its settling confirms them together
        for topic, key, value, headers in p.messages:
            self._produce(topic, key, value, headers, cb)
        if not slot.sent:
            slot.since = self.clock.monotonic()
        slot.sent.append(cb)

    def _produce(self, topic: str, key: bytes | None, value: bytes | None, headers: Any, cb: Any) -> None:
        while True:
            try:
                if headers is None:
                    # Positional (topic, value, key, partition, callback): confluent-kafka parses keyword
                    # arguments at about twice the cost. -1 is RD_KAFKA_PARTITION_UA, its default: the
                    # partitioner picks from the key.
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

    def delivery_failed(self, p: Pending, err: Any, msg: Any = None) -> None:
        p.attempts += 1
        rec = p.record
        # A purge is the worker's own doing (an abort, a producer replaced), logged once where it is decided.
        quiet = isinstance(err, KafkaError) and err.code() in _PURGE_CODES
        if quiet and self.settling.purging:
            err = PURGED  # librdkafka's "Local: Purged in queue" does not say why
        (log.debug if quiet else log.warning)(
            "delivery failed (attempt %d): %s", p.attempts, err,
            extra={"id": rec.id, "topic": rec.tp.topic, "offset": rec.offset})
        if (isinstance(err, KafkaError) and err.code() in _TOO_LARGE and msg is not None
                and (rec.tp, rec.offset) not in self.too_large):
            # The topic takes smaller messages than this producer may write: the same bytes would be refused
            # at every retry, and at every restart. Sent again as an error result and a dead letter without
            # the original bytes (exactly-once: after the abort, through emit()).
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
            p.retry_at = self.clock.monotonic() + min(0.05 * p.attempts, 0.5)
            self.retry_queue.append(p)
        else:
            self.on_failed(p.record, describe(err))
        p.round += 1  # the round failed: its other reports are ignored, and settling does not confirm it

    def _smaller_messages(self, p: Pending, topic: str, why: str) -> list[Message]:
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
            value = self.results.encode(rec, "error", None, error, 0, 0.0, 0.0, self.clock.monotonic(),
                                        self.clock.time() * 1000.0)
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
        p = Pending(rec, self)
        if rec.id is not None and not (topic == self.output_topic and owed_dead_letter):
            p.messages.append((self.output_topic, rec.key, self.result_bytes(o, now, now_wall_ms), None))
        stage = o.dlq_stage or "output"  # (always set here: see emit())
        p.messages.append((self.dlq_topic, *self._dead_letter_message(
            rec, stage, o.error or stage, refused if topic == self.dlq_topic else None)))
        rec.failed = True
        self._send(p)
        return o

    # ---- retries
    def retry_failed(self) -> None:
        """Re-send the failed records whose backoff has passed. Never sleeps: it runs on the loop thread,
        and an outage fails every in-flight delivery at once."""
        if not self.retry_queue:
            return
        now = self.clock.monotonic()
        queue, self.retry_queue = self.retry_queue, []
        for p in queue:
            if self.is_stale(p.record):
                continue
            if p.retry_at > now:
                self.retry_queue.append(p)
                continue
            self._send(p)
