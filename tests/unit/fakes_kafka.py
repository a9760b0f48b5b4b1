"""Fakes of the confluent-kafka Consumer/Producer, a fake clock, a synchronous fake device and a harness
that builds a ``Runner`` on them, for deterministic single-threaded unit tests of the runner's logic.

Everything runs on the test's thread: the test plays the broker (``FakeConsumer.append``), the group
coordinator (``assign``/``revoke``/``lose``), the device (``FakeDevice.take``/``finish``) and the
network (``FakeProducer.hold``/``fail_next``). Blocking calls (``consume(timeout)``, ``poll(timeout)``,
``flush``, ``time.sleep``) advance the ``FakeTime`` clock instead of waiting, so a test never sleeps.

What the fakes mimic of the real clients (confluent-kafka 2.x):
- rebalance callbacks fire inside ``consume``/``poll`` (``schedule``) or at once (``assign`` ...), and
  ``close()`` calls ``on_revoke`` for the current assignment, like librdkafka's close with a rebalance
  callback; an exception raised by a callback escapes ``consume``/``poll``/``close`` (as in the real
  client) so a test sees it;
- paused partitions return nothing; ``seek`` moves the fetch position; ``committed`` answers
  ``OFFSET_INVALID`` for a partition without a commit; every client call after ``close`` raises
  ``RuntimeError("Consumer closed")``;
- ``produce`` raises ``BufferError`` when the local queue is full and ``KafkaException(MSG_SIZE_TOO_LARGE)``
  for a message over ``message.max.bytes``; delivery reports fire only from ``poll``/``flush``, and with
  ``delivery.report.only.error`` (the worker's default) only for failures; ``len()`` is what is still
  unreported (librdkafka's out-queue length);
- a transactional producer keeps what each transaction produced: ``visible`` is what a ``read_committed``
  reader sees (committed transactions only, or every delivered message without transactions);
- once a message of the open transaction failed (``abortable``, set by a failed delivery or by the test: what
  librdkafka's message timer does before the report is served), ``produce`` raises ``_STATE`` and
  ``commit_transaction`` an error that requires an abort, until ``abort_transaction``;
- a ``commit_transaction`` that fails retriably without requiring an abort (a timeout: the commit goes on in
  the background) leaves ``abort_transaction`` and ``begin_transaction`` refused with ``_CONFLICT`` until
  ``commit_transaction`` is called again.
"""

from __future__ import annotations

import itertools
from collections import defaultdict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import pytest
from confluent_kafka import OFFSET_BEGINNING, OFFSET_END, OFFSET_INVALID, KafkaError, KafkaException
from confluent_kafka import TopicPartition as KTP

from worker.core.records import Batch, TopicPartition
from worker.kafka.clients import PRODUCER_DEFAULTS

TIMESTAMP_CREATE_TIME = 1
Hook = Callable[[], None]


# ----------------------------------------------------------------------------------------------- clock
class FakeTime:
    """The clock a Runner is given (``Runner(clock=...)``), and the ``time`` module of the modules that still
    read it (worker.output.emit, worker.pipeline.intake, ...).

    ``monotonic``/``perf_counter`` start at 1000 s, ``time`` at a fixed wall clock; ``sleep`` advances
    both (and records the request), so code that waits finishes at once and a test can assert on the
    time it would have waited."""

    WALL0 = 1_700_000_000.0

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start
        self.start = start
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.t

    perf_counter = monotonic

    def time(self) -> float:
        return self.WALL0 + (self.t - self.start)

    def time_ms(self) -> int:
        return int(self.time() * 1000)

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.advance(seconds)

    def advance(self, seconds: float) -> None:
        if seconds > 0:
            self.t += seconds


# ----------------------------------------------------------------------------------------------- messages
class FakeMessage:
    """confluent_kafka.Message look-alike."""

    __slots__ = ("_topic", "_partition", "_offset", "_value", "_key", "_headers", "_timestamp", "_error")

    def __init__(self, topic: str, partition: int, offset: int, value: bytes | None, key: bytes | None = None,
                 headers: list[tuple[str, bytes | None]] | None = None, timestamp_ms: int | None = None,
                 error: KafkaError | None = None) -> None:
        self._topic = topic
        self._partition = partition
        self._offset = offset
        self._value = value
        self._key = key
        self._headers = headers
        self._timestamp = (TIMESTAMP_CREATE_TIME, timestamp_ms) if timestamp_ms is not None else (0, -1)
        self._error = error

    @classmethod
    def failure(cls, err: KafkaError, topic: str = "in", partition: int = 0, offset: int = -1) -> FakeMessage:
        return cls(topic, partition, offset, None, error=err)

    def topic(self) -> str:
        return self._topic

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def value(self) -> bytes | None:
        return self._value

    def key(self) -> bytes | None:
        return self._key

    def headers(self) -> list[tuple[str, bytes | None]] | None:
        return self._headers

    def timestamp(self) -> tuple[int, int]:
        return self._timestamp

    def error(self) -> KafkaError | None:
        return self._error

    def __len__(self) -> int:
        return len(self._value or b"")

    def __repr__(self) -> str:
        return f"FakeMessage({self._topic}[{self._partition}]@{self._offset}, err={self._error})"


_json = msgspec.json.Encoder()


def request(id: str | None, inputs: Any = 1.0, **fields: Any) -> bytes:
    """A JSON request value: ``{"id", "inputs", **fields}`` (``id=None`` leaves the id out)."""
    body: dict[str, Any] = {"inputs": inputs, **fields}
    if id is not None:
        body["id"] = id
    return _json.encode(body)


def tp_of(k: KTP) -> TopicPartition:
    return TopicPartition(k.topic, k.partition)


def ktps(tps: Iterable[tuple[str, int]]) -> list[KTP]:
    return [KTP(t, p) for t, p in tps]


# ----------------------------------------------------------------------------------------------- metadata
@dataclass
class _PartitionMeta:
    id: int


@dataclass
class _TopicMeta:
    topic: str
    partitions: dict[int, _PartitionMeta]


@dataclass
class _ClusterMeta:
    topics: dict[str, _TopicMeta]
    brokers: dict[int, Any] = field(default_factory=lambda: {1: "broker-1"})


class _GroupMetadata:
    def __init__(self, group: str) -> None:
        self.group = group

    def __repr__(self) -> str:
        return f"GroupMetadata({self.group})"


# ----------------------------------------------------------------------------------------------- consumer
class FakeConsumer:
    """A one-process "broker + group" for one consumer. Logs are per partition; ``append`` writes to
    them. ``assign``/``revoke``/``lose`` run the rebalance callbacks now; ``schedule`` runs a callable
    inside the next ``consume``/``poll`` (where librdkafka fires them)."""

    def __init__(self, clock: FakeTime | None = None, config: dict[str, Any] | None = None) -> None:
        self.clock = clock
        self.config = dict(config or {})
        self.logs: dict[TopicPartition, list[FakeMessage]] = defaultdict(list)
        self.positions: dict[TopicPartition, int] = {}
        # librdkafka's application position: after the last message returned, unknown (OFFSET_INVALID) after
        # an assign or a seek until a message is returned (what position() answers).
        self.app_positions: dict[TopicPartition, int] = {}
        self.markers: set[tuple[TopicPartition, int]] = set()  # (partition, offset) of transaction markers
        self.committed_offsets: dict[TopicPartition, int] = {}
        self.assignment_set: list[TopicPartition] = []
        self.paused: set[TopicPartition] = set()
        # High watermarks as of the last fetch (get_watermark_offsets(cached=True)): a paused partition's go
        # stale.
        self.fetched_high: dict[TopicPartition, int] = {}
        self.watermark_queries: list[TopicPartition] = []  # cached=False calls (a broker round trip each)
        self.topics: list[str] = []
        self.callbacks: dict[str, Callable[..., None] | None] = {}
        self.hooks: list[Hook] = []  # run at the start of every consume/poll
        self._scheduled: deque[Hook] = deque()
        self._errors: deque[FakeMessage] = deque()
        self.pause_calls: list[list[TopicPartition]] = []
        self.resume_calls: list[list[TopicPartition]] = []
        self.commit_calls: list[dict[TopicPartition, int]] = []  # successful and failed, in order
        self.commit_failures: deque[KafkaException | BaseException] = deque()
        self.seek_calls: list[tuple[TopicPartition, int]] = []
        self.consume_calls = 0
        self.poll_calls = 0
        self.poll_timeouts: list[float | None] = []
        self._cursor = 0
        self.broker_down = False
        self.closed = False

    # ---- test side: the broker
    def append(self, topic: str, partition: int, value: bytes | None, *, key: bytes | None = None,
               headers: list[tuple[str, bytes | None]] | None = None, offset: int | None = None,
               timestamp_ms: int | None = None) -> int:
        """Write a record to a partition's log; ``offset`` may skip ahead (compaction gaps)."""
        tp = TopicPartition(topic, partition)
        log = self.logs[tp]
        off = offset if offset is not None else (log[-1].offset() + 1 if log else 0)
        if log and off <= log[-1].offset():
            raise ValueError(f"offsets must increase: {off} after {log[-1].offset()}")
        log.append(FakeMessage(topic, partition, off, value, key, headers, timestamp_ms))
        return off

    def append_marker(self, topic: str, partition: int) -> int:
        """A transaction's commit marker: it takes an offset that no consume returns, and the consumer's
        position steps over it (as librdkafka's does, in read_committed and read_uncommitted alike)."""
        off = self.append(topic, partition, None)
        self.markers.add((TopicPartition(topic, partition), off))
        return off

    def _step_over_markers(self, tp: TopicPartition, pos: int) -> int:
        while (tp, pos) in self.markers:
            pos += 1
        return pos

    def inject_error(self, err: KafkaError, topic: str = "in", partition: int = 0, offset: int = -1) -> None:
        """The next consume returns this error message first."""
        self._errors.append(FakeMessage.failure(err, topic, partition, offset))

    def high_watermark(self, tp: TopicPartition) -> int:
        log = self.logs.get(tp)
        return log[-1].offset() + 1 if log else 0

    def sibling(self) -> FakeConsumer:
        """Another consumer of the same broker and group: the logs, markers and the group's commits are
        shared, nothing else (no assignment, no callbacks)."""
        c = FakeConsumer(self.clock)
        c.logs, c.markers, c.committed_offsets = self.logs, self.markers, self.committed_offsets
        return c

    # ---- test side: the group coordinator
    def schedule(self, fn: Hook) -> None:
        self._scheduled.append(fn)

    def assign(self, *tps: tuple[str, int]) -> None:
        """Incremental assign (cooperative-sticky): on_assign(consumer, partitions), then fetching starts
        at the committed offset (auto.offset.reset=earliest without one)."""
        parts = [TopicPartition(*t) for t in tps]
        for tp in parts:
            if tp not in self.assignment_set:
                self.assignment_set.append(tp)
            self.positions[tp] = max(self.committed_offsets.get(tp, 0), 0)
            self.app_positions.pop(tp, None)
        cb = self.callbacks.get("on_assign")
        if cb is not None:
            before = {tp: self.committed_offsets.get(tp) for tp in parts}
            cb(self, ktps(parts))
            # librdkafka fetches the commit to start from after the callback: one made inside it counts.
            for tp in parts:
                if self.committed_offsets.get(tp) != before[tp]:
                    self.positions[tp] = self.committed_offsets[tp]

    def revoke(self, *tps: tuple[str, int]) -> None:
        parts = [TopicPartition(*t) for t in tps] or list(self.assignment_set)
        cb = self.callbacks.get("on_revoke")
        try:
            if cb is not None:
                cb(self, ktps(parts))
        finally:
            self._unassign(parts)

    def lose(self, *tps: tuple[str, int]) -> None:
        parts = [TopicPartition(*t) for t in tps] or list(self.assignment_set)
        cb = self.callbacks.get("on_lost") or self.callbacks.get("on_revoke")
        try:
            if cb is not None:
                cb(self, ktps(parts))
        finally:
            self._unassign(parts)

    def _unassign(self, parts: list[TopicPartition]) -> None:
        # Like librdkafka, a partition's pause is kept: assigned again, it is still paused until resumed.
        for tp in parts:
            if tp in self.assignment_set:
                self.assignment_set.remove(tp)
            self.positions.pop(tp, None)

    # ---- client API
    def _check_open(self) -> None:
        if self.closed:
            raise RuntimeError("Consumer closed")

    def subscribe(self, topics: list[str], on_assign: Callable[..., None] | None = None,
                  on_revoke: Callable[..., None] | None = None,
                  on_lost: Callable[..., None] | None = None) -> None:
        self._check_open()
        self.topics = list(topics)
        self.callbacks = {"on_assign": on_assign, "on_revoke": on_revoke, "on_lost": on_lost}

    def _run_hooks(self) -> None:
        for h in list(self.hooks):
            h()
        while self._scheduled:
            self._scheduled.popleft()()

    def _fetch(self, n: int) -> list[FakeMessage]:
        for tp in self.assignment_set:  # as librdkafka: the watermark a fetch response carried
            if tp not in self.paused:
                self.fetched_high[tp] = self.high_watermark(tp)
        out: list[FakeMessage] = []
        while self._errors and len(out) < n:
            out.append(self._errors.popleft())
        progress = True
        while len(out) < n and progress:  # round robin over the fetchable partitions, one record each
            progress = False
            k = len(self.assignment_set)
            for i in range(k):
                if len(out) >= n:
                    break
                tp = self.assignment_set[(self._cursor + i) % k]
                if tp in self.paused:
                    continue
                pos = self.positions.get(tp, 0)
                nxt = next(
                    (
                        m
                        for m in self.logs.get(tp, ())
                        if m.offset() >= pos and (tp, m.offset()) not in self.markers
                    ),
                    None,
                )
                if nxt is None:
                    end = self._step_over_markers(tp, pos)
                    if end != pos:
                        self.positions[tp] = self.app_positions[tp] = end
                    continue
                out.append(nxt)
                self.positions[tp] = self.app_positions[tp] = self._step_over_markers(tp, nxt.offset() + 1)
                progress = True
                self._cursor = (self._cursor + i + 1) % k  # the next call goes on with the next partition
                break
        return out

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[FakeMessage]:
        self._check_open()
        self.consume_calls += 1
        self._run_hooks()
        out = self._fetch(num_messages)
        if not out and self.clock is not None and timeout > 0:
            self.clock.advance(timeout)
        return out

    def poll(self, timeout: float | None = None) -> FakeMessage | None:
        self._check_open()
        self.poll_calls += 1
        self.poll_timeouts.append(timeout)
        self._run_hooks()
        out = self._fetch(1)
        if not out and self.clock is not None and timeout:
            self.clock.advance(timeout)
        return out[0] if out else None

    def assignment(self) -> list[KTP]:
        self._check_open()
        return ktps(self.assignment_set)

    def pause(self, partitions: list[KTP]) -> None:
        self._check_open()
        tps = [tp_of(k) for k in partitions]
        self.pause_calls.append(tps)
        self.paused.update(tp for tp in tps if tp in self.assignment_set)

    def resume(self, partitions: list[KTP]) -> None:
        self._check_open()
        tps = [tp_of(k) for k in partitions]
        self.resume_calls.append(tps)
        self.paused.difference_update(tps)

    def commit(self, message: Any = None, offsets: list[KTP] | None = None,
               asynchronous: bool = True) -> list[KTP] | None:
        self._check_open()
        if offsets is None:
            raise NotImplementedError("the fake commits explicit offsets only")
        done = {tp_of(k): k.offset for k in offsets}
        self.commit_calls.append(done)
        on_commit = self.config.get("on_commit")
        failure: BaseException | None = None
        if self.commit_failures:
            failure = self.commit_failures.popleft()
        elif self.broker_down:
            failure = KafkaException(KafkaError(KafkaError._TRANSPORT, "broker down"))
        if failure is not None:
            if not asynchronous or on_commit is None or not isinstance(failure, KafkaException):
                raise failure
            # As librdkafka: an asynchronous commit's broker error is reported to on_commit inside poll().
            err = failure.args[0]
            self._scheduled.append(lambda: on_commit(err, ktps(done)))
            return None
        self.committed_offsets.update(done)
        if asynchronous:
            if on_commit is not None:
                reported = [KTP(tp.topic, tp.partition, o) for tp, o in done.items()]
                self._scheduled.append(lambda: on_commit(None, reported))
            return None
        return [KTP(tp.topic, tp.partition, o) for tp, o in done.items()]

    def committed(self, partitions: list[KTP], timeout: float | None = None) -> list[KTP]:
        self._check_open()
        return [KTP(k.topic, k.partition,
                    self.committed_offsets.get(tp_of(k), OFFSET_INVALID)) for k in partitions]

    def position(self, partitions: list[KTP]) -> list[KTP]:
        self._check_open()
        return [KTP(k.topic, k.partition,
                    self.app_positions.get(tp_of(k), OFFSET_INVALID)) for k in partitions]

    def seek(self, partition: KTP) -> None:
        self._check_open()
        tp = tp_of(partition)
        off = partition.offset
        if off == OFFSET_BEGINNING:
            off = 0
        elif off == OFFSET_END:
            off = self.high_watermark(tp)
        self.seek_calls.append((tp, partition.offset))
        self.positions[tp] = off
        self.app_positions.pop(tp, None)

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> _ClusterMeta:
        self._check_open()
        if self.broker_down:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "broker down"))
        parts: dict[str, set[int]] = defaultdict(set)
        for tp in self.logs:
            parts[tp.topic].add(tp.partition)
        for t in self.topics:
            parts[t].add(0)
        return _ClusterMeta(
            {t: _TopicMeta(t, {p: _PartitionMeta(p) for p in sorted(ps)}) for t, ps in parts.items()}
        )

    def get_watermark_offsets(self, partition: KTP, timeout: float | None = None,
                              cached: bool = False) -> tuple[int, int]:
        self._check_open()
        tp = tp_of(partition)
        log = self.logs.get(tp)
        if cached:
            return (OFFSET_INVALID, self.fetched_high.get(tp, OFFSET_INVALID))
        self.watermark_queries.append(tp)
        return (log[0].offset() if log else 0, self.high_watermark(tp))

    def consumer_group_metadata(self) -> _GroupMetadata:
        self._check_open()
        return _GroupMetadata(str(self.config.get("group.id", "group")))

    def close(self) -> None:
        """Like librdkafka: leaving the group revokes the assignment through the rebalance callback."""
        self._check_open()
        try:
            if self.assignment_set and self.callbacks.get("on_revoke") is not None:
                self.revoke(*self.assignment_set)
        finally:
            self.closed = True


# ----------------------------------------------------------------------------------------------- producer
@dataclass
class Produced:
    topic: str
    value: bytes | None
    key: bytes | None
    headers: list[tuple[str, bytes]] | None
    partition: int = 0
    offset: int = -1
    txn: int | None = None  # index of the transaction it was produced in
    error: KafkaError | None = None

    def header(self, name: str) -> str | None:
        for k, v in self.headers or ():
            if k == name:
                return None if v is None else v.decode()
        return None

    def json(self) -> Any:
        assert self.value is not None
        return msgspec.json.decode(self.value)


class _Report:
    """The Message object a delivery callback receives."""

    def __init__(self, p: Produced) -> None:
        self._p = p

    def topic(self) -> str:
        return self._p.topic

    def partition(self) -> int:
        return self._p.partition

    def offset(self) -> int:
        return self._p.offset

    def value(self) -> bytes | None:
        return self._p.value

    def key(self) -> bytes | None:
        return self._p.key

    def headers(self) -> list[tuple[str, bytes]] | None:
        return self._p.headers

    def error(self) -> KafkaError | None:
        return self._p.error


class FakeProducer:
    """Delivery reports queue up and fire from ``poll``/``flush`` (``hold`` keeps them queued).
    ``fail_next(n, topic=...)`` makes the next ``n`` matching deliveries fail; ``fail_if`` a predicate."""

    def __init__(self, clock: FakeTime | None = None, config: dict[str, Any] | None = None,
                 queue_limit: int = 100_000, max_message_bytes: int = 1_000_000) -> None:
        self.clock = clock
        self.config = dict(config or {})
        self.transactional = "transactional.id" in self.config
        self.queue_limit = queue_limit
        self.max_message_bytes = max_message_bytes
        self.pending: deque[tuple[Produced, Callable[..., None] | None]] = deque()
        self.purged: deque[tuple[Produced, Callable[..., None] | None]] = deque()
        self.produced: list[Produced] = []  # every accepted produce() call, in order
        self.delivered: list[Produced] = []  # delivery report OK, in order
        self.failed: list[Produced] = []  # delivery report with an error
        self.hold = False
        self._fail_rules: list[list[Any]] = []  # [remaining (None = forever), topic or None, err]
        self.fail_if: Callable[[Produced], KafkaError | None] | None = None
        self.hooks: list[Hook] = []  # run at the start of every poll/flush
        self.unknown_topics: set[str] = set()  # produce() raises _UNKNOWN_TOPIC for these
        self._offsets: dict[str, itertools.count[int]] = defaultdict(itertools.count)
        # transactions
        self.txn_calls: list[tuple[Any, ...]] = []
        self.txn_failures: dict[str, deque[BaseException]] = defaultdict(deque)
        self.txn_index = 0
        self.in_txn = False
        self.fatal_error: KafkaError | None = None
        self.abortable = False  # a message of the open transaction failed: only abort_transaction is accepted
        self.commit_in_progress = False  # commit_transaction timed out: call it again before anything else
        self._txn_offsets: dict[TopicPartition, int] = {}
        # the consumer group's committed offsets (the Harness shares the consumer's dict)
        self.group_offsets: dict[TopicPartition, int] = {}
        self.committed_txns: set[int] = set()
        self.aborted_txns: set[int] = set()
        self.flush_calls = 0
        self.poll_calls = 0
        self.purge_calls = 0

    # ---- failure injection
    def fail_next(self, n: int | None = 1, topic: str | None = None,
                  err: KafkaError | None = None) -> None:
        """The next ``n`` deliveries (to ``topic``, if given) fail; ``n=None``: every one from now on."""
        self._fail_rules.append([n, topic, err or KafkaError(KafkaError._MSG_TIMED_OUT, "Message timed out")])

    def fail_txn(self, step: str, exc: BaseException) -> None:
        """The next transaction call ``step`` (init, begin, send_offsets, commit, abort) raises ``exc``."""
        self.txn_failures[step].append(exc)

    def fence(self, reason: str = "Fenced by a newer instance with the same transactional.id") -> None:
        """A fatal error from now on: every produce and transaction call raises it (zombie fencing)."""
        self.fatal_error = KafkaError(KafkaError._FENCED, reason, fatal=True)

    def _failure_for(self, p: Produced) -> KafkaError | None:
        if self.fail_if is not None:
            err = self.fail_if(p)
            if err is not None:
                return err
        for rule in self._fail_rules:
            remaining, topic, err = rule
            if topic is not None and topic != p.topic:
                continue
            if remaining is None:
                return err
            if remaining > 0:
                rule[0] = remaining - 1
                return err
        return None

    # ---- client API
    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None, partition: int = -1,
                on_delivery: Callable[..., None] | None = None, timestamp: int = 0,
                headers: list[tuple[str, bytes]] | None = None,
                callback: Callable[..., None] | None = None) -> None:
        if self.fatal_error is not None:
            raise KafkaException(self.fatal_error)
        if topic in self.unknown_topics:  # librdkafka, once metadata says the topic does not exist
            raise KafkaException(KafkaError(KafkaError._UNKNOWN_TOPIC,
                                            "Unable to produce message: Local: Unknown topic"))
        if len(self.pending) >= self.queue_limit:
            raise BufferError("Local: Queue full")
        # librdkafka's rule (rd_kafka_msg_max_wire_size): 36 bytes of record overhead + key + value + each
        # header's name and value, each after its length as a zigzag varint.
        def varint(n: int) -> int:
            return max(1, ((n << 1).bit_length() + 6) // 7)

        size = (
            36
            + len(value or b"")
            + len(key or b"")
            + sum(
                varint(len(k.encode())) + len(k.encode()) + varint(len(v or b"")) + len(v or b"")
                for k, v in headers or ()
            )
        )
        if size > self.max_message_bytes:
            raise KafkaException(KafkaError(KafkaError.MSG_SIZE_TOO_LARGE,
                                            "Unable to produce message: Broker: Message size too large"))
        if self.transactional and not self.in_txn:
            raise KafkaException(KafkaError(KafkaError._STATE, "Operation not valid in state Ready"))
        if self.abortable:
            raise KafkaException(KafkaError(KafkaError._STATE,
                                            "Unable to produce message: Local: Erroneous state"))
        p = Produced(topic, value, key, headers, partition=max(partition, 0),
                     txn=self.txn_index if self.transactional else None)
        self.produced.append(p)
        self.pending.append((p, on_delivery or callback))

    def _serve(self) -> int:
        n = 0
        while self.purged:  # reports of messages purged by abort_transaction: _PURGE_QUEUE, even when held
            p, cb = self.purged.popleft()
            p.error = KafkaError(KafkaError._PURGE_QUEUE, "Local: Purged in queue")
            self.failed.append(p)
            n += 1
            if cb is not None:
                cb(p.error, _Report(p))
        while self.pending and not self.hold:
            n += self._report(*self.pending.popleft())
        return n

    def deliver(self, match: Callable[[Produced], bool]) -> int:
        """Serve the queued reports of the messages ``match`` selects now (even while held), in order,
        leaving the others queued: deliveries that complete out of order."""
        keep: deque[tuple[Produced, Callable[..., None] | None]] = deque()
        chosen = []
        for item in self.pending:
            (chosen if match(item[0]) else keep).append(item)
        self.pending = keep
        return sum(self._report(p, cb) for p, cb in chosen)

    def _report(self, p: Produced, cb: Callable[..., None] | None) -> int:
        p.error = self._failure_for(p)
        if p.error is None:
            p.offset = next(self._offsets[p.topic])
            self.delivered.append(p)
        else:
            self.failed.append(p)
            if self.transactional and p.txn == self.txn_index and self.in_txn:
                self.abortable = True
        if cb is not None and (p.error is not None or not self.config.get("delivery.report.only.error")):
            cb(p.error, _Report(p))
        return 1

    def _run_hooks(self) -> None:
        for h in list(self.hooks):
            h()

    def poll(self, timeout: float | None = None) -> int:
        self.poll_calls += 1
        self._run_hooks()
        n = self._serve()
        if not n and self.clock is not None and timeout:
            self.clock.advance(timeout)
        return n

    def flush(self, timeout: float | None = None) -> int:
        self.flush_calls += 1
        self._run_hooks()
        self._serve()
        if self.pending and self.clock is not None and timeout:
            self.clock.advance(timeout)  # waited the whole timeout in vain
        return len(self.pending)

    def __len__(self) -> int:
        return len(self.pending)

    def purge(self, in_queue: bool = True, in_flight: bool = True, blocking: bool = True) -> None:
        """librdkafka's purge: every message not yet reported fails with _PURGE_QUEUE at the next poll."""
        self.purge_calls += 1
        self.purged.extend(self.pending)
        self.pending.clear()

    # ---- transactions
    def _txn(self, name: str, *args: Any) -> None:
        self.txn_calls.append((name, *args))
        if self.fatal_error is not None:
            raise KafkaException(self.fatal_error)
        q = self.txn_failures.get(name)
        if q:
            raise q.popleft()

    def init_transactions(self, timeout: float | None = None) -> None:
        self._txn("init")

    def _conflict(self) -> None:
        if self.commit_in_progress:
            raise KafkaException(KafkaError(KafkaError._CONFLICT,
                                            "Conflicting commit_transaction API call is "
                                            "already in progress", retriable=True))

    def begin_transaction(self) -> None:
        self._txn("begin")
        self._conflict()
        if self.in_txn:
            raise KafkaException(KafkaError(KafkaError._STATE, "transaction already in progress"))
        self.in_txn = True
        self.txn_index += 1

    def send_offsets_to_transaction(self, positions: list[KTP], group_metadata: Any,
                                    timeout: float | None = None) -> None:
        offsets = {tp_of(k): k.offset for k in positions}
        self._txn("send_offsets", offsets)
        self._txn_offsets.update(offsets)

    def commit_transaction(self, timeout: float | None = None) -> None:
        try:
            self._txn("commit")
        except KafkaException as e:
            err = e.args[0]
            if err.retriable() and not err.txn_requires_abort() and not err.fatal():
                self.commit_in_progress = True
            raise
        self.commit_in_progress = False
        self._serve()  # commit flushes first; what cannot be delivered in time fails the commit
        if self.abortable:
            raise KafkaException(KafkaError(KafkaError._MSG_TIMED_OUT, "Local: Message timed out",
                                            txn_requires_abort=True))
        if self.pending:
            self.commit_in_progress = True
            if self.clock is not None and timeout:
                self.clock.advance(timeout)  # waited the whole timeout for the acknowledgements
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "Local: Timed out", retriable=True))
        self.committed_txns.add(self.txn_index)
        self.group_offsets.update(self._txn_offsets)  # the group's offsets commit with the transaction
        self._txn_offsets = {}
        self.in_txn = False

    def abort_transaction(self, timeout: float | None = None) -> None:
        if self.commit_in_progress:
            self.txn_calls.append(("abort",))
            self._conflict()
        self.abortable = False
        self._txn_offsets = {}
        self.purged.extend(self.pending)  # their reports come with _PURGE_QUEUE on the next poll
        self.pending.clear()
        self._txn("abort")
        self.aborted_txns.add(self.txn_index)
        self.in_txn = False

    def txn_offsets(self) -> list[dict[TopicPartition, int]]:
        """Offsets sent to each transaction, in order (committed or not)."""
        return [c[1] for c in self.txn_calls if c[0] == "send_offsets"]

    # ---- what readers see
    def visible(self, topic: str) -> list[Produced]:
        """What a read_committed consumer of ``topic`` sees."""
        if not self.transactional:
            return [p for p in self.delivered if p.topic == topic]
        return [p for p in self.delivered if p.topic == topic and p.txn in self.committed_txns]

    def results(self) -> list[Any]:
        return [p.json() for p in self.visible("out")]

    def dead_letters(self) -> list[Produced]:
        return self.visible("dlq")


# ----------------------------------------------------------------------------------------------- model /
# device
class FakeModel:
    """A handler that echoes its inputs (``{"echo": x}``); an input equal to ``"poison"`` fails alone (as
    the engine's bisection isolates it); ``input_type`` is configurable to test validation."""

    name = "fake"
    version = "1"
    output_type: Any = Any
    uses_torch = False

    def __init__(self, input_type: Any = Any, output: Callable[[Any], Any] | None = None) -> None:
        self.input_type = input_type
        self.output = output or (lambda x: {"echo": x})
        self.forward_calls: list[list[Any]] = []

    def setup(self, device: str) -> None:
        pass

    def decode(self, inputs: Any) -> Any:
        if inputs == "undecodable-by-model":
            raise ValueError("the handler cannot decode this")
        return inputs

    def collate(self, items: list[Any]) -> list[Any]:
        return list(items)

    def forward(self, batch: list[Any]) -> list[Any]:
        self.forward_calls.append(list(batch))
        return batch

    def split(self, output: list[Any], n: int) -> list[Any]:
        return output

    def run(self, items: list[Any]) -> list[Any]:
        """What DeviceWorker hands to done(): one output, or an exception for a poison record."""
        outs = self.split(self.forward(self.collate(items)), len(items))
        return [ValueError("poison record") if x == "poison" else self.output(x) for x in outs]

    @property
    def calls(self) -> int:
        return len(self.forward_calls)


class FakeDevice:
    """A DeviceWorker the test drives: ``take()`` asks the runner's scheduler for the next batch (what the
    collate thread does), ``finish(batch)`` runs the model and calls the runner's ``done`` (what the
    finish thread does). Nothing runs by itself, so the test chooses completion order."""

    def __init__(self, runner: Any, model: FakeModel, name: str = "fake-device", index: int = 0) -> None:
        self.runner = runner
        self.model = model
        self.name = name
        self.index = index  # its place in runner.workers: take/done count per device, as DeviceWorker's do
        self.started = False
        self.stopped = False
        self.auto = False  # when True, every consumer/producer poll runs all ready batches
        self.error: BaseException | None = None  # as DeviceWorker: set when a pipeline thread died
        self.stop_requested = False
        self.busy_since: float | None = None  # what DeviceWorker.busy_for reports (the test sets it)

    def start(self) -> None:
        self.started = True

    def request_stop(self) -> None:
        self.stop_requested = True

    def busy_for(self, now: float) -> float:
        return now - self.busy_since if self.busy_since is not None else 0.0

    def stop(self, timeout: float | None = None) -> bool:
        self.stopped = True
        return True

    def take(self) -> Batch | None:
        return self.runner.dispatch.take(0.0, worker=self.index)

    def finish(self, batch: Batch, outputs: list[Any] | None = None, infer_s: float = 0.001) -> None:
        if outputs is None:
            outputs = self.model.run([r.item for r in batch.records])
        self.runner.dispatch.done(batch, outputs, {"infer": infer_s, "pipeline": infer_s}, worker=self.index)

    def run_all(self) -> int:
        """Take and finish batches until none is ready. Returns the number of records run."""
        n = 0
        while (b := self.take()) is not None:
            n += len(b.records)
            self.finish(b)
        return n

    def hook(self) -> None:
        if self.auto and not self.stopped:
            self.run_all()


# ----------------------------------------------------------------------------------------------- harness
BASE_CONFIG: dict[str, Any] = {
    "kafka": {"input_topics": ["in"], "output_topic": "out", "dlq_topic": "dlq", "group_id": "g",
              "commit_interval_ms": 3_600_000, "poll_max_records": 500},
    "model": {"name": "identity", "device": "cpu", "warmup": False},
    "delivery": {"revoke_timeout_ms": 200, "shutdown_timeout_s": 5},
    "metrics": {"enabled": False, "lag_interval_s": 3600},
}


def make_config(**sections: dict[str, Any]) -> Any:
    """BASE_CONFIG with ``sections`` merged in (one level deep: ``kafka={"commit_interval_ms": 5}``)."""
    from worker.config.settings import from_dict

    data: dict[str, Any] = {k: dict(v) for k, v in BASE_CONFIG.items()}
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return from_dict(data, environ={})


class Harness:
    """A Runner wired to the fakes, set up the way ``Runner.run`` sets itself up, minus the loop.

    Drive it with ``iterate()`` (one loop turn), the consumer's ``assign``/``revoke``/``append``, the
    devices' ``take``/``finish`` and the producer's ``hold``/``fail_next``; or call ``run()`` for the real
    loop (then script the test with ``consumer.hooks``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, cfg: Any = None, *, model: FakeModel | None = None,
                 store: Any = None, devices: int = 1, metrics: Any = None, spare: bool = False,
                 wrap_consumer: Callable[[FakeConsumer], Any] | None = None, **runner_kw: Any) -> None:
        import worker.pipeline.runner as wr

        self.cfg = cfg if cfg is not None else make_config()
        self.clock = FakeTime()
        # The runner hands this clock to every room it builds (Runner(clock=...)): nothing reads ``time``.
        # Built now so a test can script them before run(); make_consumer/make_producer hand them out.
        self.consumer = FakeConsumer(self.clock)
        self.producer = FakeProducer(self.clock)
        self.producer.group_offsets = self.consumer.committed_offsets
        # At-least-once runs with a spare producer (worker.output.emit); most tests read one producer's
        # messages, so a test asks for the spare explicitly.
        self.spare: FakeProducer | None = FakeProducer(self.clock) if spare else None
        made: list[FakeProducer] = []
        self.replacements: list[FakeProducer] = []  # producers made to replace a stalled one, in order
        self.consumers: list[FakeConsumer] = []  # every consumer the runner made; ``consumer`` is the last

        def make_consumer(cfg: Any, **extra: Any) -> FakeConsumer:
            # The first is the one built above; a runner that replaces its consumer gets a sibling.
            c = self.consumer.sibling() if self.consumers else self.consumer
            c.config = dict(extra)
            self.consumers.append(c)
            self.consumer = c
            # A wrapper the runner holds instead (a proxy that times every call, say); ``inner`` is the
            # consumer.
            return c if wrap_consumer is None else wrap_consumer(c)

        def make_producer(cfg: Any, **extra: Any) -> FakeProducer:
            # The first call makes the producer, a second one the spare (Harness(spare=True)); later ones
            # replace a stalled producer (worker.output.emit), listed in ``replacements``.
            if not made:
                p = self.producer
            elif len(made) == 1 and self.spare is not None:
                p = self.spare
            else:
                p = FakeProducer(self.clock)
                self.replacements.append(p)
            made.append(p)
            p.config = {**PRODUCER_DEFAULTS, **cfg.kafka.producer, **extra}
            p.transactional = "transactional.id" in extra
            return p

        self.model = model or FakeModel()
        self.runner = wr.Runner(self.cfg, self.model, store=store, metrics=metrics, spare_producer=spare,
                                clock=self.clock, new_consumer=make_consumer, new_producer=make_producer,
                                load_devices=self._load_devices, **runner_kw)
        self.devices = [FakeDevice(self.runner, self.model,
                                   name=f"fake-{i}", index=i) for i in range(devices)]

    @property
    def device(self) -> FakeDevice:
        return self.devices[0]

    def _load_devices(self, dispatch: Any) -> list[tuple[FakeModel, FakeDevice]]:
        return [(self.model, d) for d in self.devices]  # no torch, no engine, no threads

    def start(self) -> Harness:
        """Set up exactly as ``Runner.run`` does (models, intake, clients, transactions, emitter, devices,
        subscribe): ``Runner.start``; no loop, no close."""
        r = self.runner
        assert r.start()
        assert r.ready.is_set() and getattr(r.consumer, "inner", r.consumer) is self.consumer
        assert r.producer is self.producer
        return self

    def run(self, max_polls: int = 20_000) -> int:
        """The real ``Runner.run`` (loop, shutdown, close) on the fakes; script it with ``c.hooks`` (they run
        inside every consume/poll) and end it with ``runner.stop()`` from a hook. A run that polls more
        than ``max_polls`` times fails the test instead of hanging it."""

        def guard() -> None:
            if self.c.consume_calls + self.c.poll_calls > max_polls:
                raise AssertionError(f"Runner.run did not finish within {max_polls} polls")

        self.c.hooks.insert(0, guard)
        return int(self.runner.run())

    # ---- shorthands
    @property
    def c(self) -> FakeConsumer:
        return self.consumer

    @property
    def p(self) -> FakeProducer:
        return self.producer

    def on_polls(self, steps: dict[int, Hook], then: Hook | None = None) -> None:
        """Script ``run()``: ``steps[n]`` runs once, inside the n-th ``consumer.poll`` (the first client call
        of each loop turn, and the only one while draining); ``then`` once in every later poll."""
        seen: set[int] = set()
        last = max(steps, default=0)

        def hook() -> None:
            n = self.c.poll_calls
            if n in seen:
                return  # the consume() of the same turn
            seen.add(n)
            if n in steps:
                steps[n]()
            elif then is not None and n > last:
                then()

        self.c.hooks.append(hook)

    def iterate(self, n: int = 1, consume: bool = True) -> None:
        for _ in range(n):
            self.runner.step(consume=consume)

    def process(self) -> None:
        """One round trip of what is already consumed: a loop turn (consume, admit, batch), every queued batch
        on the fake device, and a loop turn that emits the results (and serves the delivery reports)."""
        self.iterate()
        self.device.run_all()
        self.iterate()

    def commit(self) -> None:
        self.runner.mode.commit()

    def send(self, n: int, topic: str = "in", partition: int = 0, **fields: Any) -> list[int]:
        """Append ``n`` valid requests (ids ``<topic>-<partition>-<offset>``) to a partition's log."""
        offs = []
        for _ in range(n):
            off = self.c.high_watermark(TopicPartition(topic, partition))
            offs.append(self.c.append(topic, partition, request(f"{topic}-{partition}-{off}", off, **fields)))
        return offs

    def committed(self, topic: str = "in", partition: int = 0) -> int | None:
        return self.c.committed_offsets.get(TopicPartition(topic, partition))

    def result_ids(self) -> list[str]:
        return [r["id"] for r in self.p.results()]
