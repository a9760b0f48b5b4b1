"""Exactly-once mode: results, dead letters and input offsets commit in one Kafka transaction.

Why a reorder buffer: lanes finish out of order, but a transaction may only contain results of records
inside the offset prefix it commits; otherwise a crash after the commit would replay a record whose result
is already visible, and a ``read_committed`` reader would see it twice. So outcomes are emitted per
partition in offset order, and at each checkpoint every produced record is inside the committed prefix.

Checkpoint (every ``kafka.commit_interval_ms``, on revoke and on shutdown):
  flush the producer -> the done prefix per partition -> send_offsets_to_transaction -> commit_transaction
  -> begin the next one. On failure: abort, and the runner rewinds the consumer to the committed offsets.
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Iterator
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka import TopicPartition as KTP

from worker.core.records import Outcome, TopicPartition

log = logging.getLogger("worker.transactions")


class Fenced(RuntimeError):
    """Another instance with the same transactional.id took over: this one must stop (zombie fencing)."""


class TransactionalCommitter:
    def __init__(self, producer: Any, consumer: Any, timeout_s: float = 30.0) -> None:
        self.producer = producer
        self.consumer = consumer
        self.timeout = timeout_s
        self.order: dict[TopicPartition, deque[int]] = {}
        self.ready: dict[TopicPartition, dict[int, Outcome]] = {}
        self.in_txn = False
        self.commits = 0
        self.aborts = 0

    def init(self) -> None:
        self.producer.init_transactions(self.timeout)
        self._begin()

    def _begin(self) -> None:
        self.producer.begin_transaction()
        self.in_txn = True

    # ---- ordering
    def track(self, tp: TopicPartition, offset: int) -> None:
        q = self.order.get(tp)
        if q is None:
            q = self.order[tp] = deque()
            self.ready[tp] = {}
        q.append(offset)

    def release(self, outcome: Outcome) -> Iterator[Outcome]:
        """Accepts an outcome; yields the outcomes that may be produced now, in offset order."""
        tp = outcome.record.tp
        q = self.order.get(tp)
        if q is None:
            return
        ready = self.ready[tp]
        ready[outcome.record.offset] = outcome
        while q and q[0] in ready:
            yield ready.pop(q.popleft())

    def drop(self, tps: set[TopicPartition]) -> None:
        for tp in tps:
            self.order.pop(tp, None)
            self.ready.pop(tp, None)

    # ---- checkpoints
    def checkpoint(self, offsets: dict[TopicPartition, int]) -> bool:
        """Commits the open transaction with ``offsets``. False (after aborting) when it failed."""
        try:
            if offsets:
                self.producer.send_offsets_to_transaction(
                    [KTP(tp.topic, tp.partition, o) for tp, o in offsets.items()],
                    self.consumer.consumer_group_metadata(), self.timeout)
            self.producer.commit_transaction(self.timeout)
            self.commits += 1
            self.in_txn = False
            self._begin()
            return True
        except KafkaException as e:
            err = e.args[0]
            if err.fatal() or "fenced" in str(err).lower():
                raise Fenced(f"transactional producer fenced or fatal: {err}") from e
            log.warning("transaction commit failed; aborting: %s", err)
            self.abort()
            return False

    def abort(self) -> None:
        try:
            self.producer.abort_transaction(self.timeout)
        except KafkaException as e:
            if e.args[0].fatal():
                raise Fenced(f"abort failed fatally: {e.args[0]}") from e
            log.warning("abort_transaction failed: %s", e)
        self.aborts += 1
        self.in_txn = False
        self._begin()

    def close(self) -> None:
        if self.in_txn:
            with contextlib.suppress(KafkaException):
                self.producer.abort_transaction(5.0)
            self.in_txn = False
