"""Applies the backpressure decision (worker/core/backpressure.py) to the consumer: pause and resume."""

from __future__ import annotations

import logging

from confluent_kafka import KafkaException
from confluent_kafka import TopicPartition as KTP

from worker.core.backpressure import partitions_to_pause
from worker.pipeline.context import Loop

log = logging.getLogger("worker.runner")


class FlowControl:
    def __init__(self, loop: Loop) -> None:
        self.loop = loop
        # The decision's hysteresis, per reason: the in-flight bound holds every partition, lanes held full
        # (partitions held for their span: PartitionTable).
        self._holding = False
        self._full_lanes: set[str] = set()

    def apply(self) -> None:
        in_flight = self.loop.tracker.in_flight()
        self.loop.metrics.gauge("in_flight", in_flight)
        bound = self.loop.cfg.batching.max_in_flight
        span_bound, ratio = self.loop.cfg.batching.max_uncommitted, self.loop.cfg.batching.resume_ratio
        full = self._full_lanes = self.loop.dispatch.over_bound(self._full_lanes, ratio)
        lanes_of, default_lane = self.loop.intake.topic_lanes, self.loop.cfg.batching.default_lane
        # Only the partitions near their bound matter (a handful of len() calls per turn otherwise).
        tracker, low = self.loop.tracker, span_bound * ratio
        parts = self.loop.partitions
        assigned, paused = parts.assigned, parts.paused
        reached = parts.reached if self.loop.stop_at is not None else set()
        spans = {tp: n for tp in assigned if (n := tracker.span(tp)) > low}
        want, self._holding, span_held = partitions_to_pause(
            in_flight=in_flight, bound=bound, resume_ratio=ratio, assigned=assigned, holding=self._holding,
            reached=reached, full_lanes=full,
            lane_of=lambda tp: lanes_of.get(tp.topic, default_lane), spans=spans, span_bound=span_bound,
            span_held=parts.span_held)
        parts.set_span_held(span_held)
        # A partition that has returned no record since its assignment may still be looking up where to
        # start (no commit: auto.offset.reset). librdkafka, paused and resumed meanwhile, can run that lookup
        # twice and deliver the partition's first records again after the worker processed them (design
        # notes: "A partition's first records read twice"). It is paused once it returns its first record;
        # until then a poll at the in-flight bound reads one record.
        want -= {tp for tp in want - paused
                 if tp not in reached and (p := parts.live(tp)) is not None and p.position is None}
        for tp, n in spans.items():
            if n >= span_bound and tp not in paused:
                log.warning("partition paused: %d records read since its oldest unfinished record "
                            "(offset %s), batching.max_uncommitted=%d",
                            n, tracker.first_pending(tp), span_bound,
                            extra={"topic": tp.topic, "partition": tp.partition})
        if want != paused:
            to_pause = want - paused
            to_resume = (paused - want) & assigned
            if to_pause:
                self.loop.consumer.pause([KTP(t, p) for t, p in to_pause])
            if to_resume:
                resumed = [KTP(t, p) for t, p in to_resume]
                self.loop.consumer.resume(resumed)
                self._wake_fetcher(resumed)
            parts.set_paused(to_pause)
            parts.set_paused(paused - want, False)
            self.loop.metrics.gauge("paused_partitions", len(want))
            log.debug("backpressure: %d partitions paused (in flight %d, bound %d)", len(want), in_flight,
                      bound)

    def _wake_fetcher(self, parts: list[KTP]) -> None:
        """librdkafka does not wake a broker thread that had nothing left to fetch when its partitions are
        resumed: their first fetch would wait for its next wake-up, up to about a second (design note 13).
        Seeking a resumed partition to its own position, which is where the fetch resumes anyway, wakes its
        broker thread. A partition without a position (nothing read since it was assigned or rewound) is left
        as it is: its fetch starts where librdkafka decides, at most a wake-up later."""
        try:
            positions = self.loop.consumer.position(parts)
        except KafkaException as e:
            log.debug("no positions to wake the fetcher: %s", e)
            return
        for k in positions:
            if k.offset < 0:
                continue
            try:
                self.loop.consumer.seek(k)
            except KafkaException as e:  # e.g. revoked meanwhile: nothing to wake
                log.debug("could not wake the fetcher of %s[%d]: %s", k.topic, k.partition, e)

