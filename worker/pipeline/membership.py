"""The consumer's group membership: making and subscribing the consumer, the rebalance callbacks, the
release of revoked or lost partitions, and replacing a consumer that stays out of its group."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaException
from confluent_kafka import TopicPartition as KTP

from worker.core.membership import RejoinWatch
from worker.core.records import TopicPartition
from worker.pipeline.context import Loop
from worker.pipeline.delivery import DeliveryMode
from worker.pipeline.results import Results
from worker.timing.clock import Deadline

log = logging.getLogger("worker.runner")
# Reading the group's commits of partitions lost earlier, inside the assign callback (it holds the loop): at
# worst those records are processed again, as without the read.
RESUME_QUERY_TIMEOUT_S = 5.0


class Membership:
    def __init__(self, loop: Loop, mode: DeliveryMode, results: Results, *, group_id: str,
                 new_consumer: Callable[..., Any], on_client_error: Callable[[Any], None],
                 on_assign_offsets: Callable[[Any, list[KTP]], None] | None = None) -> None:
        self.loop = loop
        self.mode = mode
        self.results = results
        self.group_id = group_id
        self._new_consumer = new_consumer
        self._on_client_error = on_client_error
        self._on_assign_offsets = on_assign_offsets
        # A consumer out of its group too long is replaced (worker/core/membership.py); the replaced ones
        # close on threads of their own, kept here (a close can wait for the broker).
        self.rejoin = RejoinWatch(loop.cfg.kafka.rejoin_timeout_s())
        self.closing_consumers: list[threading.Thread] = []

    def _while_current(self, made: list[Any], callback: Callable[..., None]) -> Callable[..., None]:
        """``callback`` for the consumer ``made[0]``, called only while it is the runner's consumer: a
        replaced one closes on a thread of its own, and what that close serves (revokes, commit reports,
        errors) must not touch the loop's state. By the object the runner holds, not the one librdkafka passes
        a rebalance callback: the runner may hold a wrapper (tests/bench/profile_worker.py times every call).
        """

        def call(*args: Any) -> None:
            if made[0] is self.loop.consumer:
                callback(*args)

        return call

    def make_consumer(self) -> Any:
        made: list[Any] = []
        made.append(self._new_consumer(self.loop.cfg, **{
            "group.id": self.group_id, "on_commit": self._while_current(made, self.mode.on_commit),
            "error_cb": self._while_current(made, self._on_client_error)}))
        return made[0]

    def subscribe(self) -> None:
        made = [self.loop.consumer]
        self.loop.consumer.subscribe(self.loop.cfg.input_topics(),
                                     on_assign=self._while_current(made, self._on_assign),
                                     on_revoke=self._while_current(made, self._on_revoke),
                                     on_lost=self._while_current(made, self._on_lost))
        # A member once its first assignment (an empty one too) comes.
        self.rejoin.out(self.loop.clock.monotonic())

    def replace_consumer(self, now: float) -> None:
        """The consumer has been out of its group longer than a rejoin can take (``kafka.rejoin_timeout_ms``):
        a new one subscribes in its place and the old one closes on another thread. Nothing is lost: the
        partitions were released when the assignment was lost, and the new member reads from the commits."""
        old = self.loop.consumer
        log.error("the consumer has been out of its group for %.0f s "
                  "(allowed: %.0f s, kafka.rejoin_timeout_ms): replacing it with a new one",
                  self.rejoin.out_for(now), self.rejoin.allowance_s,
                  extra={"group": self.group_id, "replacements": self.rejoin.replacements + 1})
        if self.loop.partitions.assigned:
            self.release(set(self.loop.partitions.assigned), graceful=False)
        self.loop.consumer = self.make_consumer()
        self.mode.replace_consumer(self.loop.consumer)
        self.subscribe()
        self.rejoin.replaced(now)
        self.loop.metrics.event("rebalances", kind="replace")
        t = threading.Thread(target=self._close_replaced, args=(old,), name="kiw-consumer-close", daemon=True)
        self.closing_consumers = [c for c in self.closing_consumers if c.is_alive()] + [t]
        t.start()

    @staticmethod
    def _close_replaced(consumer: Any) -> None:
        try:
            consumer.close()
            log.info("replaced consumer closed")
        except Exception:
            log.exception("closing the replaced consumer")

    # ---- rebalance callbacks (loop thread, inside poll)
    def _on_assign(self, consumer: Any, partitions: list[KTP]) -> None:
        self.rejoin.joined()
        try:
            self.loop.partitions.assign(TopicPartition(p.topic, p.partition) for p in partitions)
            self.loop.metrics.event("rebalances", kind="assign")
            if self.loop.health is not None:
                self.loop.health.assigned = bool(self.loop.partitions.assigned)
            log.info("partitions assigned",
                     extra={"partitions": [f"{p.topic}[{p.partition}]" for p in partitions]})
            if self.loop.tracker.lost():
                try:
                    self._resume_lost(consumer, partitions)
                except Exception:  # the hook, pause and resume below must still happen
                    log.exception("error in on_assign (resuming lost partitions)")
            if self._on_assign_offsets is not None:
                try:
                    self._on_assign_offsets(consumer, partitions)
                # The pause / resume below must still happen, or a paused partition stays so.
                except Exception:
                    log.exception("error in on_assign (choosing start offsets)")
            if partitions and self.loop.lifecycle.stopping:
                # Assigned while shutting down (a peer left during the drain): nothing more is read, and the
                # drain's poll(0) would return its records only to drop them. Paused, it is committed where
                # its group left it and handed over on close.
                consumer.pause(partitions)
                self.loop.partitions.set_paused(TopicPartition(p.topic, p.partition) for p in partitions)
            elif partitions:
                # librdkafka keeps a partition's pause through a revoke and a new assign, while the partition
                # table forgets what it paused of a released partition: resumed here, the table's "not
                # paused" is true.
                consumer.resume(partitions)
        except Exception:  # never let an exception escape a rebalance callback raw
            log.exception("error in on_assign")

    def _resume_lost(self, consumer: Any, partitions: list[KTP]) -> None:
        """At-least-once: partitions this worker lost (its session expired, or it replaced its consumer) come
        back to it. What it delivered of them since its last commit was never committed: read from the group's
        commit, all of it would be processed and produced a second time (after a broker restart: thousands of
        records, device time spent on answers the output topic already has). In the first assignment after the
        loss (the rejoin's; what other partitions left is dropped then), where the group's commit is still
        inside what this worker tracked of the partition and short of the offset up to which it delivered
        every record (results delivered after the loss count too), that offset is committed now, before
        librdkafka fetches the commit to start from, and reading goes on there.

        Safe: every record below it has a result on the output topic, which is the guarantee (per record, not
        per consumer). A commit outside that range is left alone: another member committed further; the
        offsets were reset below what this worker read (an operator's rewind is honoured); the partition has
        no commit and its log no longer spans what this worker read (a recreated topic). Exactly-once never
        gets here: a lost partition's transaction is aborted, so nothing it produced is visible."""
        held: dict[TopicPartition, tuple[int, int]] = {}
        for p in partitions:
            tp = TopicPartition(p.topic, p.partition)
            span = self.loop.tracker.take_lost(tp)
            if span is not None:
                held[tp] = span
        # Only the assignment that follows the loss (the rejoin's) may use what it left. A partition that went
        # to another member comes back, if ever, after that member committed what it did; meanwhile its
        # offsets may have been reset or its topic recreated, and what this worker read then says nothing of
        # them.
        self.loop.tracker.forget_lost()
        if not held or self.loop.lifecycle.stopping:
            return
        deadline = Deadline(RESUME_QUERY_TIMEOUT_S, self.loop.clock)  # for all the reads together
        try:
            group = consumer.committed([KTP(tp.topic, tp.partition) for tp in held],
                                       timeout=RESUME_QUERY_TIMEOUT_S)
        except KafkaException as e:
            log.warning("partitions lost earlier are back, but their commits could not be read (%s): reading "
                        "on from the commits, so what was delivered since them is processed again", e)
            return
        moves: dict[TopicPartition, int] = {}
        skipped: dict[str, int] = {}
        for k in group:
            tp = TopicPartition(k.topic, k.partition)
            first, done = held.get(tp, (0, -1))
            if k.error is not None:
                continue
            if k.offset < 0 and self._still_holds(consumer, k, first, done, deadline.left()):
                # No commit yet (lost before the first one, the usual case when it is lost early on): reading
                # would start where auto.offset.reset says, and this worker read from ``first``.
                moves[tp] = done
                skipped[f"{tp.topic}[{tp.partition}]"] = done - first
            elif first <= k.offset < done:
                moves[tp] = done
                skipped[f"{tp.topic}[{tp.partition}]"] = done - k.offset
        if not moves:
            return
        try:
            consumer.commit(offsets=[KTP(tp.topic, tp.partition, off) for tp, off in moves.items()],
                            asynchronous=False)
        except KafkaException as e:
            log.warning("partitions lost earlier are back, but committing what this worker delivered of them "
                        "failed (%s): reading on from the commits, so that is processed again", e)
            return
        self.loop.partitions.set_committed(moves)
        self.loop.metrics.event("lost_records_skipped", n=sum(skipped.values()))
        log.info("partitions lost earlier are back: going on after the records this worker already delivered",
                 extra={"skipped": skipped, "resume_at": {f"{tp.topic}[{tp.partition}]": off
                                                          for tp, off in moves.items()}})

    @staticmethod
    def _still_holds(consumer: Any, k: KTP, first: int, done: int, timeout: float) -> bool:
        """A partition without a commit still holds the offsets ``[first, done)`` this worker read. Why:
        without a commit nothing tells a partition whose topic was deleted and created again (its offsets now
        other records) from the one this worker read; a new log short of ``done``, or not reaching back to
        ``first``, is not taken for it. No answer within ``timeout`` (what is left of the reads' 5 s): not
        taken."""
        if timeout <= 0:
            return False
        try:
            lo, hi = consumer.get_watermark_offsets(KTP(k.topic, k.partition), timeout=timeout, cached=False)
        except KafkaException:
            return False
        return lo is not None and hi is not None and 0 <= lo <= first and done <= hi

    def _on_revoke(self, consumer: Any, partitions: list[KTP]) -> None:
        tps = {TopicPartition(p.topic, p.partition) for p in partitions}
        try:
            # After a fatal error nothing more will complete: do not wait out revoke_timeout for it.
            self.release(tps, graceful=self.loop.lifecycle.fatal is None)
            self.loop.metrics.event("rebalances", kind="revoke")
        except Exception as e:
            log.exception("error in on_revoke")
            self.mode.on_refused(e)
            # The partitions are gone whatever failed (waiting, flushing, committing): forget them, or their
            # dropped records stay "in flight" for good (backpressure) and their late outputs get produced.
            try:
                self.release(tps, graceful=False)
            except Exception as e2:
                log.exception("error releasing the revoked partitions")
                self.mode.on_refused(e2)

    def _on_lost(self, consumer: Any, partitions: list[KTP]) -> None:
        self.rejoin.out(self.loop.clock.monotonic())
        try:
            tps = {TopicPartition(p.topic, p.partition) for p in partitions}
            self.release(tps, graceful=False)
            self.loop.metrics.event("rebalances", kind="lost")
        except Exception as e:
            log.exception("error in on_lost")
            self.mode.on_refused(e)

    def release(self, tps: set[TopicPartition], graceful: bool) -> None:
        """Revoke: queued records of these partitions are dropped (not yet started: the new owner will
        process them); records already on a device get ``revoke_timeout_ms`` to finish and be delivered;
        what is done is committed synchronously; the rest is dropped."""
        loop, mode = self.loop, self.mode
        dropped = loop.dispatch.revoke(tps)
        if graceful:
            # The revoke of consumer.close() after a shutdown: what could finish had shutdown_timeout_s.
            revoke = Deadline(loop.cfg.delivery.revoke_timeout_ms / 1000.0, loop.clock)
            deadline = revoke.within(loop.lifecycle.shutdown)
            # Nothing at or after a partition's first dropped record can be committed now (nor, in
            # exactly-once mode, produced: it waits in the reorder buffer behind it), so only the records
            # before it count.
            first_dropped: dict[TopicPartition, int] = {}
            for r in dropped:
                if r.tp not in first_dropped or r.offset < first_dropped[r.tp]:
                    first_dropped[r.tp] = r.offset
            while not deadline.expired():
                if all(mode.settled(tp, first_dropped.get(tp)) for tp in tps):
                    break
                self.results.serve(0.005, loop.clock.monotonic())
            mode.flush(deadline.left())
            mode.commit(only=tps, flush_s=deadline.left(1.0))
            loop.gate.flush()  # the results that flush confirmed: the new owner's ledger skips them
        loop.partitions.release(tps)
        for tp in tps:
            # The Prometheus adapter keeps a gauge's last value per label set: a released partition's lag
            # would stay on /metrics (and in the total lag the autoscaler reads) until the process exits.
            loop.metrics.remove_lag(tp.topic, tp.partition)
        mode.release(tps, graceful)
        log.info("partitions released", extra={"partitions": sorted(f"{t}[{p}]" for t, p in tps),
                                               "dropped_queued": len(dropped), "graceful": graceful})

