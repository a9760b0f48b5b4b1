"""What the loop tells the outside about the broker and the backlog: consumer lag per partition, the drain
time the autoscaler reads, and whether a broker answers (for /healthz)."""

from __future__ import annotations

import logging

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka import TopicPartition as KTP

from worker.pipeline.context import Loop

log = logging.getLogger("worker.runner")
# Paused partitions whose high watermark one lag report asks the broker for, and how long each answer may
# take.
LAG_QUERIES = 4
LAG_QUERY_TIMEOUT_S = 0.5


class LagReport:
    def __init__(self, loop: Loop) -> None:
        self.loop = loop
        self.next_report = 0.0
        self._done_before = 0  # records done at the last report
        self._turn = 0  # which paused partitions ask the broker next
        from worker.observability.metrics import DrainEstimator

        self._drain = DrainEstimator(window_s=60.0)

    def due(self, now: float) -> bool:
        return now >= self.next_report

    def check_broker(self) -> None:
        try:
            md = self.loop.consumer.list_topics(timeout=10)
            ok = True
        except KafkaException as e:
            log.warning("broker not reachable: %s", e)
            ok = False
        else:
            for topic, key in self.loop.emitter.topic_keys.items():
                if topic not in md.topics:
                    # Not fatal: a broker with auto.create.topics.enable creates it on the first result. One
                    # without refuses the first result, and the worker stops then (FatalDeliveryError).
                    log.warning("%s %r does not exist on the broker yet: the first message creates it if "
                                "the broker creates topics on first use, and otherwise the worker stops",
                                key, topic, extra={"topic": topic})
        self.loop.broker_ok = ok
        if self.loop.health is not None:
            self.loop.health.broker_reachable = ok

    def on_client_error(self, err: KafkaError) -> None:
        """librdkafka's client-level errors (served inside poll, on the loop thread). They never come back
        from poll() or consume() as messages, so this is where the worker learns that no broker answers."""
        if err.code() == KafkaError._ALL_BROKERS_DOWN:
            if self.loop.broker_ok:
                log.warning("no broker reachable: %s", err)
            self.loop.broker_ok = False
            if self.loop.health is not None:
                self.loop.health.broker_reachable = False

    def report(self, now: float) -> None:
        """Consumer lag per partition (high watermark - committed) and the drain-time signal."""
        self.next_report = now + self.loop.cfg.metrics.lag_interval_s
        done = self.loop.stats.results_ok + self.loop.stats.results_error + self.loop.stats.results_expired
        self._drain.record(done - self._done_before, now, busy=self.loop.tracker.in_flight() > 0)
        self._done_before = done
        total = 0
        # librdkafka's cached high watermark comes with fetch responses, and a paused partition (backpressure)
        # fetches nothing: its lag froze exactly when the HPA needed it. A few paused partitions per report,
        # in turn, ask the broker (a round trip each); the others use the latest of that answer and the cache.
        paused = sorted(self.loop.partitions.paused)
        ask = {paused[(self._turn + i) % len(paused)] for i in range(min(LAG_QUERIES, len(paused)))}
        self._turn += len(ask)
        consumer = self.loop.consumer
        for part in self.loop.partitions.live_partitions():
            tp = part.tp
            try:
                if tp in ask:
                    _lo, hi = consumer.get_watermark_offsets(KTP(tp.topic, tp.partition),
                                                             timeout=LAG_QUERY_TIMEOUT_S, cached=False)
                    part.live_high = hi
                else:
                    _lo, hi = consumer.get_watermark_offsets(KTP(tp.topic, tp.partition), cached=True)
                    if part.live_high is not None:
                        hi = max(hi, part.live_high) if hi is not None else part.live_high
            except KafkaException:
                continue
            if hi is None or hi < 0:
                continue
            base = part.committed if part.committed is not None else (
                part.position if part.position is not None else hi)
            lag = max(hi - base, 0)
            total += lag
            self.loop.metrics.gauge("consumer_lag", lag, topic=tp.topic, partition=str(tp.partition))
        self.loop.metrics.gauge("drain_seconds", self._drain.estimate(total, now))
        self.loop.intake.report_unknown_lanes(self.loop.metrics)
        if not self.loop.broker_ok:
            # Nothing says when brokers are back while nothing arrives (an idle worker): ask for metadata.
            try:
                self.loop.consumer.list_topics(timeout=1.0)
                self.loop.broker_ok = True
                log.info("broker reachable again")
            except KafkaException:
                pass
        if self.loop.health is not None:
            self.loop.health.broker_reachable = self.loop.broker_ok

