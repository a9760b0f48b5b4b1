"""Exactly-once mode: results, dead letters and input offsets commit in one Kafka transaction.

Why a reorder buffer: lanes finish out of order, but a transaction may only contain results of records
inside the offset prefix it commits; otherwise a crash after the commit would replay a record whose result
is already visible, and a ``read_committed`` reader would see it twice. So outcomes are emitted per
partition in offset order, and at each checkpoint every produced record is inside the committed prefix.

Checkpoint (every ``kafka.commit_interval_ms``, on revoke and on shutdown):
  flush the producer -> the done prefix per partition -> send_offsets_to_transaction -> commit_transaction
  -> begin the next one. On failure: abort, and the runner rewinds the consumer to the committed offsets.
A commit that times out goes on in the background: librdkafka then refuses abort and begin (_CONFLICT) until
commit_transaction is called again, so it is called again first (COMMIT_ATTEMPTS in all).
"""

from __future__ import annotations

import contextlib
import logging
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka import TopicPartition as KTP

from worker.core.records import Outcome, TopicPartition
from worker.timing.clock import Deadline

log = logging.getLogger("worker.transactions")
# commit_transaction / abort_transaction calls (each waits up to ``timeout_s``) before a retriable error
# counts as a failure: bounded, as a revoke or a shutdown waits for them.
COMMIT_ATTEMPTS = 3
ABORT_ATTEMPTS = 3


def _call_again(call: Callable[[], None], what: str, attempts: int, again: Callable[[Any], bool],
                deadline: Deadline | None = None) -> None:
    """``call()``, called again (up to ``attempts`` calls in all, and not past ``deadline``) while it raises a
    KafkaError that ``again`` accepts; otherwise, or after the last call, its KafkaException propagates."""
    for attempt in range(1, attempts + 1):
        try:
            call()
            return
        except KafkaException as e:
            if attempt == attempts or not again(e.args[0]) or (deadline is not None and deadline.expired()):
                raise
            log.warning("%s did not complete (%s); calling it again", what, e.args[0])


class TransactionFailed(RuntimeError):
    """The producer is in a state no transaction can be started from: the worker must stop (exit 1); the next
    process starts from the committed offsets."""


class Fenced(TransactionFailed):
    """Another instance with the same transactional.id took over: this one must stop (zombie fencing)."""


class TransactionalCommitter:
    def __init__(self, producer: Any, consumer: Any, timeout_s: float = 30.0) -> None:
        self.producer = producer
        self.consumer = consumer
        self.timeout = timeout_s
        # No call waits past it, once the worker stops: the checkpoint of a shutdown ends within
        # delivery.shutdown_timeout_s (the pod's grace period), not 30 s per call and 3 calls per commit.
        self.deadline: Deadline | None = None
        self.order: dict[TopicPartition, deque[int]] = {}
        self.ready: dict[TopicPartition, dict[int, Outcome]] = {}
        self.in_txn = False
        self.commits = 0
        self.aborts = 0

    def _timeout(self) -> float:
        if self.deadline is None:
            return self.timeout
        return max(0.5, self.deadline.cap(self.timeout))

    def init(self) -> None:
        self.producer.init_transactions(self.timeout)
        self._begin()

    def _begin(self) -> None:
        try:
            self.producer.begin_transaction()
        except KafkaException as e:
            raise TransactionFailed(f"exactly-once: begin_transaction failed: {e.args[0]}") from e
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
                    self.consumer.consumer_group_metadata(), self._timeout())
            self._commit()
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

    def _commit(self) -> None:
        # A retriable error that does not require an abort (a timeout: the commit goes on in the background)
        # is only resolved by calling commit_transaction again; abort is refused meanwhile.
        _call_again(lambda: self.producer.commit_transaction(self._timeout()), "commit_transaction",
                    COMMIT_ATTEMPTS,
                    lambda err: err.retriable() and not err.fatal() and not err.txn_requires_abort(),
                    self.deadline)

    def abort(self) -> None:
        """Aborts the open transaction and begins the next one; raises TransactionFailed when it cannot be
        aborted (beginning a transaction then fails anyway, and the loop would go on producing outside
        one)."""
        try:
            _call_again(lambda: self.producer.abort_transaction(self._timeout()), "abort_transaction",
                        ABORT_ATTEMPTS,
                        lambda err: err.retriable() and not err.fatal(), self.deadline)
        except KafkaException as e:
            err = e.args[0]
            if err.fatal():
                raise Fenced(f"abort failed fatally: {err}") from e
            raise TransactionFailed(f"exactly-once: the transaction could not be aborted ({err}); "
                                    "exiting, the next process starts from the committed offsets") from e
        self.aborts += 1
        self.in_txn = False
        self._begin()

    def close(self) -> None:
        if self.in_txn:
            with contextlib.suppress(KafkaException):
                self.producer.abort_transaction(5.0)
            self.in_txn = False
