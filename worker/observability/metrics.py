"""Prometheus implementation of the ``Metrics`` port, and the drain-time estimate used for autoscaling.

Every metric lives in the instance's own ``CollectorRegistry`` (several instances can coexist in tests).
The generic port methods map onto the fixed metric set by short name (a ``kiw_`` prefix and a ``_total``
suffix are accepted too):

- ``gauge(name, value, **labels)``: ``in_flight``, ``paused_partitions``, ``consumer_lag`` {topic, partition},
  ``drain_seconds``, ``redis_circuit_open``, ``model_loaded``; for the histogram ``commit_seconds`` the value
  is observed.
- ``event(name, n, **labels)``: ``commit_failures``, ``dlq`` {stage}, ``oom_splits`` {lane},
  ``redis_errors`` {op}, ``rebalances`` {kind}, ``batches`` {lane, reason}, ``records_in`` {lane},
  ``records_out`` {lane, status}, ``preemptions`` {lane}, ``unknown_lane`` {topic}, ``suspects_isolated``,
  ``ledger_skips``, ``producer_replacements``, ``lost_records_skipped``.

Unknown names are ignored with a debug log line; missing labels become ``""`` and extra labels are dropped.
An observation hook never raises into the pipeline.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
from bisect import bisect_left
from collections import deque
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["BATCH_SIZE_BUCKETS", "CONTENT_TYPE_LATEST", "FILL_RATIO_BUCKETS", "LATENCY_BUCKETS",
           "DrainEstimator", "PrometheusMetrics"]

log = logging.getLogger("worker.metrics")

BATCH_SIZE_BUCKETS = tuple(float(2**i) for i in range(11))  # 1, 2, 4, ..., 1024
FILL_RATIO_BUCKETS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
LATENCY_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 30.0,
                   60.0)


class PrometheusMetrics:
    """``Metrics`` port on prometheus_client. ``render()`` gives the text exposition format."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        # The *_created series double the exposition for no use on a dashboard; the switch is process-wide.
        disable_created_metrics()
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.records_in_total = Counter("kiw_records_in", "Records consumed, by lane", ["lane"], registry=r)
        self.records_out_total = Counter("kiw_records_out",
                                         "Records finished (result and/or dead letter handed to "
                                         "the producer), by lane and status (ok|error|expired)",
                                         ["lane", "status"], registry=r)
        self.batch_size = Histogram("kiw_batch_size", "Records per inference batch", ["lane"],
                                    buckets=BATCH_SIZE_BUCKETS, registry=r)
        self.batch_fill_ratio = Histogram("kiw_batch_fill_ratio", "Batch size / lane max_batch_size",
                                          ["lane"],
                                          buckets=FILL_RATIO_BUCKETS, registry=r)
        self.queue_wait_seconds = Histogram("kiw_queue_wait_seconds",
                                            "Per batch: the mean time its records waited "
                                            "from receipt to dispatch",
                                            ["lane"], buckets=LATENCY_BUCKETS, registry=r)
        self.inference_seconds = Histogram("kiw_inference_seconds",
                                           "Collate + forward + split time per batch",
                                           ["lane"], buckets=LATENCY_BUCKETS, registry=r)
        self.end_to_end_seconds = Histogram("kiw_end_to_end_seconds",
                                            "Request's Kafka timestamp to its result handed to the "
                                            "producer, per record",
                                            ["lane"], buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("kiw_in_flight", "Records consumed and not yet delivered or dead-lettered",
                               registry=r)
        self.paused_partitions = Gauge("kiw_paused_partitions", "Partitions paused by backpressure",
                                       registry=r)
        self.consumer_lag = Gauge("kiw_consumer_lag", "High watermark minus committed offset",
                                  ["topic", "partition"], registry=r)
        self.drain_seconds = Gauge("kiw_drain_seconds", "Estimated seconds to consume the current lag at the "
                                   "recent throughput (scaling signal)", registry=r)
        self.commit_seconds = Histogram("kiw_commit_seconds", "Offset commit latency",
                                        buckets=LATENCY_BUCKETS,
                                        registry=r)
        self.commit_failures_total = Counter("kiw_commit_failures", "Failed offset commits", registry=r)
        self.dlq_total = Counter("kiw_dlq", "Records routed to the DLQ, by stage", ["stage"], registry=r)
        self.oom_splits_total = Counter("kiw_oom_splits",
                                        "Times a lane's max batch size was lowered (after a "
                                        "device out-of-memory error, or to a model's fixed batch size)",
                                        ["lane"], registry=r)
        self.redis_errors_total = Counter("kiw_redis_errors", "Store calls that could not use Redis "
                                          "(error or open circuit), by operation", ["op"], registry=r)
        self.redis_circuit_open = Gauge("kiw_redis_circuit_open", "1 while the Redis circuit breaker is open",
                                        registry=r)
        self.model_loaded = Gauge("kiw_model_loaded", "1 once the model is loaded and warmed up", registry=r)
        self.rebalances_total = Counter("kiw_rebalances",
                                        "Consumer group rebalances, by kind (assign|revoke|lost|replace)",
                                        ["kind"], registry=r)
        self.producer_replacements_total = Counter(
            "kiw_producer_replacements", "Producers replaced after holding results undelivered for "
            "delivery.producer_stall_s (what they held is sent again)", registry=r)
        self.lost_records_skipped_total = Counter(
            "kiw_lost_records_skipped", "Records not read again when a partition this worker lost came back "
            "to it: it had delivered their results (at-least-once)", registry=r)
        self.preemptions_total = Counter("kiw_preemptions",
                                         "Prefetched batches put back for a higher-priority "
                                         "lane's batch, by the lane put back", ["lane"], registry=r)
        self.batches_total = Counter("kiw_batches",
                                     "Batches closed, by lane and reason (count|time|idle|flush|adaptive)",
                                     ["lane", "reason"], registry=r)
        self.unknown_lane_total = Counter("kiw_unknown_lane",
                                          "Records whose x-priority header or priority field "
                                          "names no lane (served by the default lane), by topic", ["topic"],
                                          registry=r)
        self.suspects_isolated_total = Counter("kiw_suspects_isolated",
                                               "Records read with an attempt count > 0 "
                                               "(on a device when a process died), each run alone",
                                               registry=r)
        self.ledger_skips_total = Counter("kiw_ledger_skips", "Redelivered records not run again: the ledger "
                                          "holds their delivered ok result", registry=r)

        self._gauges: dict[str, Gauge] = {
            "in_flight": self.in_flight, "paused_partitions": self.paused_partitions,
            "consumer_lag": self.consumer_lag, "drain_seconds": self.drain_seconds,
            "redis_circuit_open": self.redis_circuit_open, "model_loaded": self.model_loaded,
        }
        self._histograms: dict[str, Histogram] = {
            "commit_seconds": self.commit_seconds, "batch_size": self.batch_size,
            "batch_fill_ratio": self.batch_fill_ratio, "queue_wait_seconds": self.queue_wait_seconds,
            "inference_seconds": self.inference_seconds, "end_to_end_seconds": self.end_to_end_seconds,
        }
        self._counters: dict[str, Counter] = {
            "records_in": self.records_in_total, "records_out": self.records_out_total,
            "commit_failures": self.commit_failures_total, "dlq": self.dlq_total,
            "oom_splits": self.oom_splits_total, "redis_errors": self.redis_errors_total,
            "rebalances": self.rebalances_total, "batches": self.batches_total,
            "producer_replacements": self.producer_replacements_total,
            "lost_records_skipped": self.lost_records_skipped_total,
            "preemptions": self.preemptions_total, "unknown_lane": self.unknown_lane_total,
            "suspects_isolated": self.suspects_isolated_total, "ledger_skips": self.ledger_skips_total,
        }
        self._warned: set[str] = set()

    # -- the Metrics port ---------------------------------------------------------------------------
    def records_in(self, lane: str, n: int = 1) -> None:
        self.records_in_total.labels(lane=lane).inc(n)

    def records_out(self, lane: str, status: str, n: int = 1) -> None:
        self.records_out_total.labels(lane=lane, status=status).inc(n)

    def batch(self, lane: str, size: int, fill_ratio: float, queue_wait_s: float, infer_s: float) -> None:
        self.batch_size.labels(lane=lane).observe(size)
        self.batch_fill_ratio.labels(lane=lane).observe(fill_ratio)
        self.queue_wait_seconds.labels(lane=lane).observe(max(queue_wait_s, 0.0))
        self.inference_seconds.labels(lane=lane).observe(max(infer_s, 0.0))

    def end_to_end(self, lane: str, seconds: float) -> None:
        self.end_to_end_seconds.labels(lane=lane).observe(max(seconds, 0.0))

    def end_to_end_many(self, lane: str, seconds: list[float]) -> None:
        """One batch's end-to-end latencies. ``Histogram.observe`` costs a lock and a scan of the buckets per
        value (about a quarter of the worker's CPU per record at identity-model rates), so the values are
        counted per bucket here and added once per bucket. Falls back to ``observe`` if prometheus_client's
        internals (non-cumulative ``_buckets``, ``_upper_bounds``, ``_sum``) ever change."""
        h = self.end_to_end_seconds.labels(lane=lane)
        buckets = getattr(h, "_buckets", None)
        bounds = getattr(h, "_upper_bounds", None)
        total_v = getattr(h, "_sum", None)
        if buckets is None or bounds is None or total_v is None or len(buckets) != len(bounds):
            for s in seconds:
                h.observe(s if s > 0.0 else 0.0)
            return
        counts = [0] * len(bounds)
        total = 0.0
        for s in seconds:
            if s < 0.0:
                s = 0.0
            counts[bisect_left(bounds, s)] += 1  # the first bucket whose upper bound is >= s, as observe()
            total += s
        for i, c in enumerate(counts):
            if c:
                buckets[i].inc(c)
        total_v.inc(total)

    def dlq(self, stage: str, n: int = 1) -> None:
        self.dlq_total.labels(stage=stage).inc(n)

    def gauge(self, name: str, value: float, **labels: Any) -> None:
        key = _short(name)
        try:
            g = self._gauges.get(key)
            if g is not None:
                _child(g, labels).set(value)
                return
            h = self._histograms.get(key)
            if h is not None:
                _child(h, labels).observe(value)
                return
        except (TypeError, ValueError) as e:
            log.debug("metric %s: bad value or labels (%s)", name, e)
            return
        self._unknown("gauge", name)

    def event(self, name: str, n: int = 1, **labels: Any) -> None:
        c = self._counters.get(_short(name))
        if c is None:
            self._unknown("event", name)
            return
        try:
            _child(c, labels).inc(n)
        except (TypeError, ValueError) as e:  # e.g. a negative n
            log.debug("metric %s: bad value or labels (%s)", name, e)

    # -- extras (not in the port) -------------------------------------------------------------------
    def observe(self, name: str, value: float, **labels: Any) -> None:
        """Observe a value into one of the histograms by short name (``commit_seconds``, ...)."""
        self.gauge(name, value, **labels)

    def remove_lag(self, topic: str, partition: int | str) -> None:
        """Forget a partition's lag series (after it was revoked), so stale lag does not linger."""
        with contextlib.suppress(KeyError):
            self.consumer_lag.remove(topic, str(partition))

    def render(self) -> bytes:
        """The registry in Prometheus text format (what ``/metrics`` serves)."""
        return generate_latest(self.registry)

    def _unknown(self, kind: str, name: str) -> None:
        if name not in self._warned:
            self._warned.add(name)
            log.debug("metrics.%s(%r): no such metric, ignored", kind, name)


def _short(name: str) -> str:
    if name.startswith("kiw_"):
        name = name[4:]
    if name.endswith("_total"):
        name = name[:-6]
    return name


def _child(metric: Any, labels: dict[str, Any]) -> Any:
    names = metric._labelnames  # prometheus_client keeps the declared label names here
    if not names:
        return metric
    extra = set(labels) - set(names)
    if extra:
        log.debug("metric %s: ignoring labels %s", metric._name, sorted(extra))
    return metric.labels(**{n: str(labels.get(n, "")) for n in names})


class DrainEstimator:
    """Seconds to consume the current lag at the rate this replica works at: ``lag / throughput``.

    ``record(n, now, busy)`` adds the records completed since the last call and says whether records were
    waiting on the replica (read, not yet finished) at this call. Throughput is the completions of the last
    ``window_s`` seconds divided by the *busy* time in them: an interval between two calls counts when records
    were waiting at its start or some completed in it. Idle time does not dilute the rate (a burst after an
    idle hour is not read as a replica working at a sixtieth of its speed); when the window holds no busy time
    the last measured rate stands.

    Lag 0 -> 0. ``cap_s`` (also the upper bound) only when records have been waiting for a whole window with
    none completed: the replica is stuck. Lag while no rate was ever measured and nothing is stuck (a fresh
    replica, lag made of transaction markers) -> 0: there is no evidence the replica is slow, and the cap
    would drive an HPA to its maximum. The value is always finite and usable as a scaling signal.
    """

    def __init__(self, window_s: float = 60.0, cap_s: float = 86_400.0) -> None:
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        if cap_s <= 0:
            raise ValueError(f"cap_s must be > 0, got {cap_s}")
        self.window_s = window_s
        self.cap_s = cap_s
        self._samples: deque[tuple[float, int, float]] = deque()  # (time, completed, busy seconds)
        self._prev: float | None = None  # time of the last record()
        self._prev_busy = False
        self._waiting_since: float | None = None  # records have waited since then, without a gap
        self._progress_at: float | None = None  # the last record() with completions
        self._last_rate = 0.0
        self._lock = threading.Lock()

    def record(self, completed: int, now: float, busy: bool = True) -> None:
        if completed < 0:
            raise ValueError(f"completed must be >= 0, got {completed}")
        with self._lock:
            if self._prev is not None:
                dt = max(now - self._prev, 0.0)
                busy_s = dt if (self._prev_busy or completed) else 0.0
                if busy_s > 0:
                    self._samples.append((now, completed, busy_s))
            self._prev, self._prev_busy = now, busy
            if completed:
                self._progress_at = now
            if not busy:
                self._waiting_since = None
            elif self._waiting_since is None:
                self._waiting_since = now
            rate = self._rate(now)
            if rate > 0:
                self._last_rate = rate

    def _rate(self, now: float) -> float:
        horizon = now - self.window_s
        while self._samples and self._samples[0][0] <= horizon:
            self._samples.popleft()
        busy = sum(s for _, _, s in self._samples)
        return sum(n for _, n, _ in self._samples) / busy if busy > 0 else 0.0

    def throughput(self, now: float) -> float:
        """Completed records per busy second over the window (0.0 when the window holds no busy time)."""
        with self._lock:
            return self._rate(now)

    def stuck(self, now: float) -> bool:
        """Records have waited for a whole window and none completed meanwhile."""
        with self._lock:
            if self._waiting_since is None:
                return False
            since = self._waiting_since
            if self._progress_at is not None and self._progress_at > since:
                since = self._progress_at
            return now - since >= self.window_s

    def estimate(self, lag: int | float, now: float) -> float:
        if lag <= 0:
            return 0.0
        if self.stuck(now):
            return self.cap_s
        rate = self.throughput(now) or self._last_rate
        if rate <= 0:
            return 0.0
        seconds = lag / rate
        return self.cap_s if math.isnan(seconds) else min(seconds, self.cap_s)
