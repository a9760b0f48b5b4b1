"""The one loop that wires the ports together (ARCHITECTURE sections 3 and 4).

Threads:
- the **loop thread** (the caller of ``Runner.run``) owns every Kafka client call: consume, produce, poll,
  commit, pause/resume and the rebalance callbacks;
- one **device thread** per device (``DeviceWorker``) takes the next batch from the scheduler, runs the
  model and hands the outputs back through ``self._completions``.

Commit order (at-least-once): result/DLQ produced -> delivered (the emitter settles it: design note 12) ->
tracker.ack -> the contiguous done prefix is committed every ``commit_interval_ms``, on revoke and on
shutdown. Never past a gap. The optional store (ledger, cache, attempt counters) is in ``StoreGate``.
Exactly-once: the same prefix goes into the producer's transaction with the results it covers.
"""

from __future__ import annotations

import functools
import gc
import logging
import queue
import signal
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka import TopicPartition as KTP

from worker.adapters.kafka_clients import make_consumer, make_producer, retry_transient, transactional_extra
from worker.config import Config
from worker.core.backpressure import partitions_to_pause
from worker.core.membership import RejoinWatch
from worker.core.offsets import OffsetTracker
from worker.core.ports import Metrics, Model, NullMetrics, Store
from worker.core.records import Batch, Outcome, Record, TopicPartition
from worker.core.scheduler import PriorityScheduler
from worker.emit import Emitter, FatalDeliveryError
from worker.intake import Intake
from worker.pipeline.lifecycle import Deadline, Lifecycle
from worker.pipeline.partitions import PartitionTable
from worker.store_gate import StoreGate
from worker.transactions import TransactionalCommitter, TransactionFailed

log = logging.getLogger("worker.runner")
# Records are acyclic and freed by reference counting; young-generation passes every 700 allocations (the
# default) only burn CPU on the hot path.
GC_THRESHOLD = (20_000, 20, 20)
# Exactly-once: a failed delivery aborts the transaction and the records are read again; this many such aborts
# in a row without a commit between them (the same failure each time, say a topic that refuses the record)
# end the worker instead, as max_retries failed deliveries do in at-least-once mode.
DELIVERY_ABORTS_MAX = 5
# Paused partitions whose high watermark one lag report asks the broker for, and how long each answer may take.
LAG_QUERIES = 4
LAG_QUERY_TIMEOUT_S = 0.5
# Reading the group's commits of partitions lost earlier, inside the assign callback (it holds the loop): at
# worst those records are processed again, as without the read.
RESUME_QUERY_TIMEOUT_S = 5.0


def _by_lane(records: list[Record]) -> Iterable[tuple[str, list[Record]]]:
    groups: dict[str, list[Record]] = {}
    for r in records:
        groups.setdefault(r.lane, []).append(r)
    return groups.items()


@dataclass
class RunStats:
    records_in: int = 0
    results_ok: int = 0
    results_error: int = 0
    results_expired: int = 0
    dlq: int = 0
    batches: int = 0
    batched_records: int = 0
    commits: int = 0
    started: float = field(default_factory=time.monotonic)
    ledger_skips: int = 0
    cache_hits: int = 0

    @property
    def mean_batch(self) -> float:
        return self.batched_records / self.batches if self.batches else 0.0


class Runner:
    def __init__(self, cfg: Config, model: Model | None = None, *, metrics: Metrics | None = None,
                 store: Store | None = None, devices: list[str] | None = None,
                 stop_at: dict[TopicPartition, int] | None = None,
                 on_assign_offsets: Callable[[Any, list[KTP]], None] | None = None,
                 group_id: str | None = None, install_signals: bool = False,
                 health: Any = None, reached: set[TopicPartition] | None = None,
                 spare_producer: bool = True) -> None:
        self.cfg = cfg
        self.metrics: Metrics = metrics or NullMetrics()
        self.health = health
        self._models: list[Model] = []
        self._model_arg = model
        self._device_specs = devices
        self.stop_at = stop_at  # backfill: stop when every partition reaches these end offsets
        # Every per-partition fact (epochs, pauses, positions, commits, a backfill's ends).
        self.partitions = PartitionTable(reached or ())
        self._on_assign_offsets = on_assign_offsets
        self.group_id = group_id or cfg.kafka.group_id

        lanes = cfg.batching.lanes
        self.lane_cfg = {lane.name: lane for lane in lanes}
        self.scheduler = PriorityScheduler(lanes, cfg.batching.default_lane, cfg.batching.policy,
                                           cfg.batching.bucket_width)
        self.tracker = OffsetTracker()
        self.cv = threading.Condition()
        self._completions: queue.SimpleQueue[tuple[Batch, list[Any], dict[str, float]]] = queue.SimpleQueue()
        self.lifecycle = Lifecycle()
        self.ready = self.lifecycle.ready  # set once the clients are made and subscribed
        self.stats = RunStats()
        # The backpressure decision's hysteresis, per reason (worker/core/backpressure.py): the in-flight bound
        # holds every partition, partitions held for their uncommitted span, lanes held full.
        self._holding = False
        self._full_lanes: set[str] = set()
        self._commit_in_flight: dict[TopicPartition, int] | None = None  # an asynchronous commit not yet reported
        self._commit_sent_at = 0.0
        # Per device (by its index in workers): the batches it took and has not handed back. A device is free
        # when its own count is 0 (with several, the total said a busy device was free while another was idle);
        # all are when the sum is (a suspect runs only then).
        self._busy_on: list[int] = []
        self._last_commit = time.monotonic()
        self.consumer: Any = None
        # A consumer out of its group too long is replaced (worker/core/membership.py); the replaced ones close
        # on threads of their own, kept here (a close can wait for the broker).
        self._rejoin = RejoinWatch(cfg.kafka.rejoin_timeout_s())
        self.closing_consumers: list[threading.Thread] = []
        self.producer: Any = None
        self.spare_producer: Any = None
        self._want_spare = spare_producer  # at-least-once only: see Emitter
        self.workers: list[Any] = []
        self.gate = StoreGate(store, cfg, self.stats, self.metrics)
        # Records that were on a device when an earlier process died (attempt count > 0): each one goes to the
        # device alone, so the innocent ones clear themselves and only the killer keeps counting.
        self._suspects: deque[Record] = deque()
        self._isolated = 0  # suspects on a device now: nothing else is dispatched meanwhile
        self._broker_ok = True
        self._abort_pending: str | None = None  # exactly-once: a delivery failed; abort at the end of the turn
        # Set when the consumer's position can no longer be trusted (a rewind that could not seek): nothing may
        # be committed any more, the worker exits 1 and the next process starts from the committed offsets.
        self._no_commit = False
        self._delivery_aborts = 0  # such aborts in a row, without a commit between them
        self._next_lag_report = 0.0
        self._done_at_last_lag = 0
        self._lag_turn = 0
        from worker.adapters.metrics import DrainEstimator

        self._drain = DrainEstimator(window_s=60.0)
        if install_signals:
            # Now, not in run(): a SIGTERM while the model loads (seconds to minutes) must stop the worker
            # gracefully, not kill it with the default disposition.
            signal.signal(signal.SIGTERM, self.stop)
            signal.signal(signal.SIGINT, self.stop)

    @property
    def assigned(self) -> frozenset[TopicPartition]:
        return self.partitions.assigned

    @property
    def committed(self) -> dict[TopicPartition, int]:
        """What this worker last committed, per partition (released ones too)."""
        return self.partitions.committed

    @property
    def reached(self) -> set[TopicPartition]:
        """Backfill: the partitions read up to ``stop_at``."""
        return self.partitions.reached

    @property
    def fatal(self) -> str | None:
        """Why the worker ends with exit 1, once it does."""
        return self.lifecycle.fatal

    _fatal = fatal  # the name tests/unit/test_emit.py reads

    @property
    def models_loaded(self) -> bool:
        return self.lifecycle.models_loaded

    def _fail(self, reason: str) -> None:
        self.lifecycle.fail(reason)

    # ------------------------------------------------------------------ setup
    def _build_models(self) -> None:
        from worker.adapters.torch_engine import DeviceWorker, Engine, resolve_device
        from worker.models.registry import load_model

        specs = self._device_specs or self.cfg.model.devices or [self.cfg.model.device]
        devices = [resolve_device(s) for s in specs]
        if self._model_arg is not None and len(devices) > 1:
            # One handler object cannot be set up on several devices, and the others would load cfg.model,
            # which may be another model: results would depend on the device a batch happened to run on.
            raise ValueError(f"Runner(model=...) runs one device, but the config lists {len(devices)} "
                             f"({', '.join(devices)}): pass no model (each device loads model.name) or one device")
        for i, dev in enumerate(devices):
            model = self._model_arg if (i == 0 and self._model_arg is not None) else load_model(self.cfg.model)
            engine = Engine(model, dev, dtype=self.cfg.model.dtype, compile=self.cfg.model.compile,
                            warmup=self.cfg.model.warmup, on_limit=self._on_limit,
                            max_batch_sizes={lane.name: lane.max_batch_size for lane in self.cfg.batching.lanes})
            engine.setup()
            self._models.append(model)
            i = len(self.workers)
            self.workers.append(DeviceWorker(engine, take=functools.partial(self._take, worker=i),
                                             done=functools.partial(self._done, worker=i), swap=self._swap,
                                             name=f"device-{dev}"))
        self._busy_on = [0] * len(self.workers)
        self.model = self._models[0]
        self.lifecycle.loaded()
        self.metrics.gauge("model_loaded", 1)
        # Hundreds of thousands of long-lived objects (torch, the model) would otherwise be walked by every
        # full garbage collection, which the per-record allocations trigger every few thousand records.
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLD)
        if self.health is not None:
            self.health.model_loaded = True

    def _on_limit(self, lane: str, new_max: int) -> None:
        """The engine lowers a lane's batch limit after an out-of-memory error and raises it back later."""
        with self.cv:
            lowered = new_max < self.scheduler.max_batch_size(lane)
            self.scheduler.set_max_batch_size(lane, new_max)
        if lowered:
            self.metrics.event("oom_splits", lane=lane)
        log.info("batch limit of lane %s now %d", lane, new_max, extra={"lane": lane, "max_batch_size": new_max})

    # ------------------------------------------------------------------ device side (device threads)
    def _take(self, timeout: float, worker: int) -> Batch | None:
        batch = self._next_batch(timeout, worker)
        if batch is not None:
            self.gate.count_dispatch(batch)
        return batch

    def _swap(self, batch: Batch) -> Batch | None:
        """The device is about to start ``batch`` (prefetched while it was busy): a higher-priority batch that
        became ready since goes first, and ``batch`` goes back to its lane (see PriorityScheduler.preempt).
        Its records past their deadline by now are expired first, and a partial batch taken ahead that keeps its
        place takes along what arrived since (see PriorityScheduler.top_up). Returns the batch to run instead,
        if any."""
        if batch.reason == "isolate":
            return None
        with self.cv:
            now = time.monotonic()
            was_ahead = self.scheduler.start(batch)
            current = batch
            current_rec = self.partitions.is_current
            if not all(current_rec(r) for r in batch.records):
                # Their partition was released since the batch was taken (revoke, loss, rewind): those records
                # belong to the new owner or the rewound reader now; not to expire, requeue or run here.
                current = batch.with_records([r for r in batch.records if current_rec(r)])
            # Taken up to a batch-time ago: records whose deadline passed meanwhile are expired, not run.
            trimmed = self.scheduler.drop_expired(current, now)
            if trimmed is not None:  # (possibly empty: every record expired)
                current = trimmed
            changed = current if current is not batch else None
            if self._suspects or self._isolated or not current.records:
                return changed
            better = self.scheduler.preempt(current, now)
            if better is not None:
                self.metrics.event("preemptions_total", lane=batch.lane)
            elif was_ahead:
                # Not preempted: a partial batch taken ahead takes along what its lane (and, with
                # fill_with_lower, the lower lanes) received since it was taken.
                better = self.scheduler.top_up(current, now)
            if better is None:
                return changed
            better.closed_at = now
        self.gate.count_dispatch(better)  # only its records not counted yet
        return better

    def _next_batch(self, timeout: float, worker: int) -> Batch | None:
        """``worker``: the index in ``workers`` of the device asking."""
        deadline = Deadline(timeout)
        with self.cv:
            while True:
                now = time.monotonic()
                while self._suspects and not self.partitions.is_current(self._suspects[0]):
                    self._suspects.popleft()  # revoked meanwhile
                batch = None
                if self._suspects:
                    # A suspect runs alone on an otherwise idle device (all devices), and the next batch is
                    # only taken after _done cleared its counter: so a count reaches 2 only for a record that
                    # was alone on the device when the process died.
                    if not any(self._busy_on):
                        rec = self._suspects.popleft()
                        self._busy_on[worker] += 1
                        self._isolated += 1
                        return Batch(lane=rec.lane, records=[rec], opened_at=now, closed_at=now,
                                     reason="isolate", max_batch_size=1)
                elif self._isolated == 0:  # not beside the last suspect either (other devices, pipelining)
                    # The collate stage asks for batch n+1 while batch n is on the device: then the device is
                    # busy and open windows must be left to fill (only closed ones go). A free device takes
                    # an open window at once (work-conserving).
                    idle = self._busy_on[worker] == 0
                    batch = self.scheduler.next_batch(now, idle=idle, full_only=not idle)
                if batch is not None:
                    self._busy_on[worker] += 1
                    batch.closed_at = now  # dispatch time: queue wait is measured up to here
                    return batch
                if now >= deadline.at or self.lifecycle.closed:
                    return None
                # While a suspect waits or runs, no batch is taken, so no window is closed: the scheduler's
                # wake-up stays overdue, and waiting for it spun every 0.2 ms. _done's notify is the wake-up.
                wake = None if self._suspects or self._isolated else self.scheduler.next_wakeup(now)
                until = deadline.at if wake is None else min(deadline.at, wake)
                self.cv.wait(max(until - now, 0.0002))

    def _done(self, batch: Batch, outputs: list[Any], timings: dict[str, float], worker: int) -> None:
        if batch.reason == "isolate":
            self.gate.came_back(batch)
        with self.cv:
            self._busy_on[worker] -= 1
            if batch.reason == "isolate":
                self._isolated -= 1
            if not timings.get("recovered"):
                # A batch bisected or split after an error took many forwards: as one observation it would
                # inflate the latency model the adaptive policy plans (and expires records) with.
                self.scheduler.observe(batch.lane, len(batch.records), timings.get("infer", 0.0))
            self.cv.notify_all()  # a device became free: a waiting collate stage may take an open window
        self._completions.put((batch, outputs, timings))

    # ------------------------------------------------------------------ loop side
    def stop(self, *_: Any) -> None:
        """Ask for a graceful stop (signal-safe)."""
        self.lifecycle.request_stop()
        with self.cv:
            self.cv.notify_all()

    def run(self) -> int:
        self._build_models()
        if self.lifecycle.stop_requested:
            # A stop asked for while the model loaded (which can take minutes): no clients, no group join.
            log.info("stopped during the model load")
            return 0
        self.intake = Intake(self.cfg, self.model, route=self.scheduler.lane_for)
        self.consumer = self._make_consumer()
        self.txn: TransactionalCommitter | None = None
        if self.cfg.delivery.mode == "exactly_once":
            tid = self.cfg.delivery.transactional_id or f"{self.group_id}-{socket.gethostname()}"
            self.producer = make_producer(self.cfg, **transactional_extra(self.cfg, tid))
            self.txn = TransactionalCommitter(self.producer, self.consumer)
            self.txn.init()
            log.info("exactly-once mode", extra={"transactional_id": tid})
        else:
            self.producer = make_producer(self.cfg)
            if self._want_spare:
                self.spare_producer = make_producer(self.cfg)
        self.emitter = Emitter(self.producer, self.cfg.kafka.output_topic, self.cfg.kafka.dlq_topic,
                               getattr(self.model, "name", "model"),
                               self.cfg.model.version or getattr(self.model, "version", None),
                               self.cfg.delivery.format, on_done=self._record_done, on_failed=self._record_failed,
                               is_stale=lambda r: not self.partitions.is_current(r),
                               max_message_bytes=int(self.cfg.kafka.producer.get("message.max.bytes", 1_000_000)),
                               spare_producer=self.spare_producer, on_wait=self._beat,
                               new_producer=(lambda: make_producer(self.cfg)) if self.txn is None else None,
                               stall_s=self.cfg.delivery.producer_stall_s,
                               on_replace=lambda: self.metrics.event("producer_replacements"),
                               # A delivery that failed inside a transaction cannot be retried in it (librdkafka
                               # puts the transaction in an abortable state): _record_failed aborts instead.
                               **({"max_retries": 0} if self.txn is not None else {}))
        for w in self.workers:
            w.start()
        topics = self.cfg.input_topics()
        self._check_broker()
        self._subscribe()
        if self.health is not None:
            self.health.waiting_for_assignment = True
        log.info("worker started", extra={"topics": topics, "group": self.group_id,
                                          "devices": [w.name for w in self.workers]})
        self.ready.set()
        try:
            while self.lifecycle.running:
                self._iterate()
                if self.stop_at is not None and self._backfill_complete():
                    break
            return self._shutdown()
        finally:
            self._close()

    def _iterate(self, consume: bool = True) -> None:
        """One loop turn. A message the producer refuses ends the turn and fails the lifecycle: the run loop and the
        shutdown drain both stop on it."""
        try:
            self._turn(consume)
        except FatalDeliveryError as e:
            self._fatal_if_refused(e)
        if self._abort_pending is not None and self.lifecycle.fatal is None:
            self._abort_for_failed_delivery()
        batch_timeout = self.cfg.model.batch_timeout_s
        for w in self.workers:
            if batch_timeout and self.lifecycle.fatal is None:
                busy = w.busy_for(time.monotonic())
                if busy > batch_timeout:
                    # The threads are alive and the heartbeat is fresh, but this batch will not come back: its
                    # partitions would stay unprocessed for good. Restarting is the way out (the attempt
                    # counters, with Redis, quarantine a record that hangs every time).
                    self._fail(f"{w.name}: a batch has been on the device for {busy:.0f} s "
                                   f"(model.batch_timeout_s={batch_timeout:g}); its records are not committed and "
                                   "are processed again after a restart")
            err = w.error
            if err is not None and self.lifecycle.fatal is None:
                # A thread of its pipeline died (a handler raised SystemExit, say): the batches it held never
                # come back, and waiting for them would stall the worker with a healthy heartbeat.
                self._fail(f"{w.name}: a device pipeline thread failed ({type(err).__name__}: {err}); its "
                               "records are not committed and are processed again after a restart")

    def _abortable(self, e: FatalDeliveryError) -> bool:
        """Exactly-once: once a message of the open transaction timed out, librdkafka refuses every produce() with
        _STATE ("Erroneous state") until the transaction is aborted, before the failure report is served: a
        failed delivery (abort, rewind), not a refused message. Emitter raises FatalDeliveryError ``from None``,
        so the producer's error is the exception's context."""
        ctx = e.__context__
        return (self.txn is not None and self._delivery_aborts < DELIVERY_ABORTS_MAX
                and isinstance(ctx, KafkaException) and bool(ctx.args)
                and isinstance(ctx.args[0], KafkaError) and ctx.args[0].code() == KafkaError._STATE)

    def _beat(self) -> None:
        """The loop is alive while it waits for room in the producer's full queue (up to message.timeout.ms, 120 s
        by default): without a heartbeat there, /healthz failed after 30 s and the kubelet restarted a worker
        that was only waiting for a slow broker (its records then processed twice)."""
        if self.health is not None:
            self.health.beat()

    def _turn(self, consume: bool) -> None:
        now = time.monotonic()
        if self.health is not None:
            self.health.heartbeat = now
        if consume:
            if self._rejoin.due(now):
                self._replace_consumer(now)
            # While anything is in flight (queued, on a device, or waiting for its delivery to settle) the loop
            # polls in short steps: a device that finishes cannot wake a consumer.poll(), and at light load
            # its results waited up to poll_timeout_ms for the next record to arrive (e2e p50 at 100 records/s:
            # 17 -> 10.5 ms). Checking the device instead missed the batches it had not picked up yet.
            busy = self.tracker.in_flight() > 0 or not self._completions.empty()
            timeout = 0.002 if busy else self.cfg.kafka.poll_timeout_ms / 1000.0
            # consume(n, t) waits for all n records or the whole timeout, which would add up to
            # poll_timeout_ms to every record at light load. poll() returns on the first record; then
            # consume(n - 1, 0) takes what is already fetched without waiting.
            first = self.consumer.poll(timeout)
            msgs = [first] if first is not None else []
            # Never read much past the in-flight bound: it is what keeps memory bounded under overload.
            room = max(1, self.cfg.batching.max_in_flight - self.tracker.in_flight())
            want = min(self.cfg.kafka.poll_max_records, room)
            if first is not None and want > 1:
                self.partitions.clear_rewound()
                msgs.extend(self.consumer.consume(want - 1, 0))
                rewound = self.partitions.take_rewound()
                if rewound:
                    msgs = self._drop_rewound(msgs, rewound)
            if msgs:
                self._broker_ok = True
                self._ingest(msgs)
        else:
            # Heartbeats / rebalance callbacks while draining. Every partition is paused, so this returns no
            # record; one it did return anyway is not tracked, and the drain's commits below neither step
            # over markers (which would commit the position past it) nor reach it through the tracker.
            self.consumer.poll(0)
        self._serve_results(0.0, now)
        self.gate.flush()
        if now >= self._next_lag_report:
            self._report_lag(now)
        if consume:
            self._backpressure()
        if time.monotonic() - self._last_commit >= self.cfg.kafka.commit_interval_ms / 1000.0:
            self._commit(sync=False, step=consume)

    @staticmethod
    def _unreadable_headers(tp: TopicPartition, offset: int) -> list[tuple[str, bytes]]:
        """confluent-kafka decodes header names as UTF-8 without checking the result (its c_headers_to_py), so a
        name another client wrote in another encoding makes ``headers()`` raise, at every restart. The record
        goes on without its headers (an ``x-priority`` among them is not seen)."""
        log.warning("headers of %s[%d]@%d cannot be read (a header name that is not UTF-8?): processed without them",
                    tp.topic, tp.partition, offset)
        return []

    def _drop_rewound(self, msgs: list[Any], rewound: dict[TopicPartition, int | None]) -> list[Any]:
        """A rewind served inside consume() (a revoke whose checkpoint failed) sought partitions back, but
        poll() had already returned a record of them, and consume() may return some read before the callback:
        tracked under the new epoch they would be processed twice (or out of order). Drop every message of
        those partitions from this turn and seek to the first one dropped where that is before the rewind's
        target (or where the rewind had nothing to seek to): whatever they were, they are read again."""
        keep: list[Any] = []
        first: dict[TopicPartition, int] = {}
        for m in msgs:
            tp = TopicPartition(m.topic(), m.partition())
            if m.error() is None and tp in rewound:
                if self.partitions.is_assigned(tp) and tp not in first:
                    first[tp] = m.offset()
                continue
            keep.append(m)
        for tp, off in first.items():
            target = rewound[tp]
            to = off if target is None else min(off, target)
            try:
                self.consumer.seek(KTP(tp.topic, tp.partition, to))
            except Exception as e:
                self._no_commit = True
                self._fail(f"exactly-once: could not rewind {tp.topic}[{tp.partition}] after an abort: {e}")
                log.error(self.lifecycle.fatal)
        return keep

    def _ingest(self, msgs: list[Any]) -> None:
        now = time.monotonic()
        outcomes: list[Outcome] = []
        admitted: list[Record] = []
        # Locals for the per-record loop (attribute lookups are a good part of its cost).
        live, stop_at, reached = self.partitions.live, self.stop_at, self.partitions.mark_reached
        track, txn, admit = self.tracker.track, self.txn, self.intake.admit
        n_in = 0
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.code() in (KafkaError._ALL_BROKERS_DOWN, KafkaError._TRANSPORT):
                    self._broker_ok = False
                if err.code() == KafkaError._PARTITION_EOF:
                    if self.stop_at is not None:
                        eof_tp = TopicPartition(m.topic(), m.partition())
                        if m.offset() >= self.stop_at.get(eof_tp, 0):
                            reached(eof_tp)
                else:
                    log.warning("consume error: %s", err)
                    if err.fatal():
                        self._fail(f"fatal consumer error: {err}")
                continue
            part = live((m.topic(), m.partition()))
            if part is None:
                continue  # a message of a partition revoked while it was in the fetch batch
            tp = part.tp  # one TopicPartition per partition, not one per record
            offset = m.offset()
            if stop_at is not None:
                if offset >= stop_at.get(tp, 0):
                    # Backfill: past the end snapshot taken at start; leave it for the live workers.
                    part.reached = True
                    continue
                if offset + 1 >= stop_at.get(tp, 0):
                    part.reached = True
            if not track(tp, offset):
                if txn is not None:
                    # Exactly-once: read again, already tracked (and processed, or on its way) after a rewind
                    # inside consume(): not a second result.
                    continue
                # At-least-once: librdkafka moved the position back by itself (log truncation after an unclean
                # leader election, a topic deleted and recreated): the records at those offsets are new data.
                self._position_moved_back(tp, offset)
            part.position = offset + 1
            if txn is not None:
                txn.track(tp, offset)
                if part.first_read is None:
                    part.first_read = offset
            ts_type, ts = m.timestamp()
            try:
                headers = m.headers() or []
            except Exception:  # noqa: BLE001 - one record's headers must not stop the partition for good
                headers = self._unreadable_headers(tp, offset)
            rec = Record(tp, offset, m.value(), m.key(), headers, now, ts if ts_type else None, part.epoch)
            n_in += 1
            bad = admit(rec, now)
            if bad is not None:
                outcomes.append(bad)
            else:
                admitted.append(rec)
        self.stats.records_in += n_in
        if admitted:
            admitted = self.gate.admit(admitted, outcomes, ack=self._ack_delivered_before, isolate=self._isolate)
        if admitted:
            lane_counts: Counter[str] = Counter()
            with self.cv:
                for rec in admitted:
                    lane_counts[rec.lane] += 1
                    for late in self.scheduler.add(rec, now):
                        outcomes.append(Outcome(late, "expired", error="deadline passed", dlq_stage="expired"))
                self.cv.notify_all()
            for lane, n in lane_counts.items():
                self.metrics.records_in(lane, n)
        if outcomes:
            self._emit_all(outcomes, now)

    def _position_moved_back(self, tp: TopicPartition, offset: int) -> None:
        """At-least-once: a record at or below the last offset tracked on its partition, with no rebalance in
        between. Processed (it was skipped for a moment, losing new data); tracked afresh when nothing of the
        partition is unfinished, else untracked as before (its commit cannot wait for it)."""
        log.warning("consumer position moved back on %s[%d] to offset %d (log truncated or topic recreated?): "
                    "processing from there", tp.topic, tp.partition, offset,
                    extra={"topic": tp.topic, "partition": tp.partition, "offset": offset})
        if self.tracker.pending(tp) == 0:
            self.tracker.assign([tp])
            self.tracker.track(tp, offset)

    def _ack_delivered_before(self, rec: Record) -> None:
        """The ledger says the record's result was delivered before (redelivery after a crash or rebalance)."""
        self.tracker.ack(rec.tp, rec.offset)

    def _isolate(self, suspects: list[Record]) -> None:
        """Records that were on a device when an earlier process died: each goes to the device alone."""
        with self.cv:
            self._suspects.extend(suspects)
            self.cv.notify_all()

    def _serve_results(self, poll_s: float, now: float) -> None:
        """Everything between the device and a confirmed record, once: emit what the devices finished and what
        expired, serve failure reports (waiting up to ``poll_s``), confirm what settled, re-send what failed."""
        self._drain_completions()
        self._expire()
        self.emitter.poll(poll_s)
        self.emitter.settle(now)
        self.emitter.retry_failed()

    def _expire(self) -> None:
        now = time.monotonic()
        with self.cv:
            expired = self.scheduler.expire(now)
            if self._suspects and any(r.deadline is not None and r.deadline <= now for r in self._suspects):
                expired = list(expired) + [r for r in self._suspects if r.deadline is not None and r.deadline <= now]
                self._suspects = deque(r for r in self._suspects if r.deadline is None or r.deadline > now)
        if expired:
            self._emit_all([Outcome(r, "expired", error="deadline passed before inference", dlq_stage="expired")
                            for r in expired], now)

    def _drain_completions(self) -> None:
        while True:
            try:
                batch, outputs, timings = self._completions.get_nowait()
            except queue.Empty:
                return
            self._complete_batch(batch, outputs, timings)

    def _complete_batch(self, batch: Batch, outputs: list[Any], timings: dict[str, float]) -> None:
        now = time.monotonic()
        n = len(batch.records)
        if n == 0:
            return  # every record of a batch taken ahead expired before it started (see _swap)
        self.stats.batches += 1
        self.stats.batched_records += n
        infer_s = timings.get("infer", 0.0)
        queue_wait = sum(batch.closed_at - r.received_at for r in batch.records) / n
        self.metrics.batch(batch.lane, n, batch.fill_ratio, queue_wait, infer_s)
        self.metrics.event("batches", lane=batch.lane, reason=batch.reason)
        # Without a transaction ok results go straight to the emitter's hot path: no Outcome per record,
        # metrics and stats once per batch. In exactly-once mode every outcome goes through the reorder buffer.
        wall_ms = time.time() * 1000.0
        current = self.partitions.is_current
        closed = batch.closed_at
        outcomes: list[Outcome] = []
        ok_recs: list[Record] = []
        ok_outs: list[Any] = []
        for rec, out in zip(batch.records, outputs, strict=True):
            if not current(rec):
                continue  # partition revoked meanwhile: the new owner reprocesses it
            if isinstance(out, BaseException):
                outcomes.append(Outcome(rec, "error", error=f"{type(out).__name__}: {out}", dlq_stage="inference",
                                        batch_size=n, timings={"queue": closed - rec.received_at, "infer": infer_s}))
                continue
            if rec.cache_key is not None:
                self.gate.cache_put(rec, out)
            ok_recs.append(rec)
            ok_outs.append(out)
        declined: Iterable[int] = (range(len(ok_recs)) if self.txn is not None else
                                   self.emitter.emit_ok_many(ok_recs, ok_outs, n, closed, infer_s, now, wall_ms))
        if declined:
            # Exactly-once, or what the hot path declined (unencodable, oversize): the general path.
            outcomes.extend(Outcome(ok_recs[i], "ok", output=ok_outs[i], batch_size=n,
                                    timings={"queue": closed - ok_recs[i].received_at, "infer": infer_s})
                            for i in declined)
            skip = set(declined)
            ok_recs = [r for i, r in enumerate(ok_recs) if i not in skip]
        if ok_recs:
            self.stats.results_ok += len(ok_recs)
            # A filled batch (lane option fill_with_lower) holds records of other lanes: count each by its own.
            for lane, recs in (_by_lane(ok_recs) if batch.mixed else ((batch.lane, ok_recs),)):
                self.metrics.records_out(lane, "ok", len(recs))
                e2e_s = [(wall_ms - r.produced_at_ms) / 1000.0 for r in recs if r.produced_at_ms]
                if e2e_s:
                    self.metrics.end_to_end_many(lane, e2e_s)
        if outcomes:
            self._emit_all(outcomes, now)

    def _emit_all(self, outcomes: Iterable[Outcome], now: float) -> None:
        wall_ms = time.time() * 1000.0
        st = self.stats
        # Metrics once per lane (and status) as on the hot path: in exactly-once mode every result comes here,
        # and a histogram observe() per record costs about 5 us.
        out_counts: Counter[tuple[str, str]] = Counter()
        e2e_s: dict[str, list[float]] = {}
        current = self.partitions.is_current
        emit = self.emitter.emit

        def count(o: Outcome) -> None:
            # The outcome as sent: an ok one whose output could not be written went out as an error with an
            # output dead letter (counted as ok before: kiw_dlq_total never rose however broken the results).
            if o.status == "ok":
                st.results_ok += 1
            elif o.status == "error":
                st.results_error += 1
            else:
                st.results_expired += 1
            if o.dlq_stage is not None:
                st.dlq += 1
                self.metrics.dlq(o.dlq_stage)
            rec = o.record
            out_counts[rec.lane, o.status] += 1
            if rec.produced_at_ms:
                e2e_s.setdefault(rec.lane, []).append((wall_ms - rec.produced_at_ms) / 1000.0)

        for o in outcomes:
            if not current(o.record):
                # Its partition was released since it was read (revoke, loss, rewind): the new owner or the
                # rewound reader processes it again. An outcome from here would be a second, conflicting
                # result, and in exactly-once mode it would take the re-read record's place in the order.
                continue
            if self.txn is None:
                count(emit(o, now, wall_ms))
            else:
                for ordered in self.txn.release(o):
                    count(emit(ordered, now, wall_ms))
        for (lane, status), k in out_counts.items():
            self.metrics.records_out(lane, status, k)
        for lane, xs in e2e_s.items():
            self.metrics.end_to_end_many(lane, xs)

    def _record_done(self, rec: Record) -> None:
        if self.partitions.is_current(rec):
            self.tracker.ack(rec.tp, rec.offset)
        else:
            self.tracker.ack_lost(rec.tp, rec.offset)  # its partition was lost: see _resume_lost
        self.gate.delivered(rec)

    def _record_failed(self, rec: Record, err: str) -> None:
        if not self.partitions.is_current(rec):
            return  # its partition was revoked meanwhile: the new owner processes it again
        if self.txn is not None and self._delivery_aborts < DELIVERY_ABORTS_MAX:
            # Exactly-once: abort the transaction and read again from the last commit, at the end of this loop
            # turn (this runs inside the producer's poll). A failure that comes back every time still ends the
            # worker below, after DELIVERY_ABORTS_MAX aborts in a row without a commit.
            self._abort_pending = err
            return
        self.tracker.nack(rec.tp, rec.offset)
        self._fail(f"giving up delivering the result of {rec.tp.topic}[{rec.tp.partition}]@{rec.offset}: {err}")

    def _check_broker(self) -> None:
        try:
            md = self.consumer.list_topics(timeout=10)
            ok = True
        except KafkaException as e:
            log.warning("broker not reachable: %s", e)
            ok = False
        else:
            for topic, key in self.emitter.topic_keys.items():
                if topic not in md.topics:
                    # Not fatal: a broker with auto.create.topics.enable creates it on the first result. One
                    # without refuses the first result, and the worker stops then (FatalDeliveryError).
                    log.warning("%s %r does not exist on the broker yet: the first message creates it if the "
                                "broker creates topics on first use, and otherwise the worker stops", key, topic,
                                extra={"topic": topic})
        self._broker_ok = ok
        if self.health is not None:
            self.health.broker_reachable = ok

    def _on_client_error(self, err: KafkaError) -> None:
        """librdkafka's client-level errors (served inside poll, on the loop thread). They never come back
        from poll() or consume() as messages, so this is where the worker learns that no broker answers."""
        if err.code() == KafkaError._ALL_BROKERS_DOWN:
            if self._broker_ok:
                log.warning("no broker reachable: %s", err)
            self._broker_ok = False
            if self.health is not None:
                self.health.broker_reachable = False

    def _report_lag(self, now: float) -> None:
        """Consumer lag per partition (high watermark - committed) and the drain-time signal."""
        self._next_lag_report = now + self.cfg.metrics.lag_interval_s
        done = self.stats.results_ok + self.stats.results_error + self.stats.results_expired
        self._drain.record(done - self._done_at_last_lag, now, busy=self.tracker.in_flight() > 0)
        self._done_at_last_lag = done
        total = 0
        # librdkafka's cached high watermark comes with fetch responses, and a paused partition (backpressure)
        # fetches nothing: its lag froze exactly when the HPA needed it. A few paused partitions per report, in
        # turn, ask the broker (a round trip each); the others use the latest of that answer and the cache.
        paused = sorted(self.partitions.paused)
        ask = {paused[(self._lag_turn + i) % len(paused)] for i in range(min(LAG_QUERIES, len(paused)))}
        self._lag_turn += len(ask)
        for part in self.partitions.live_partitions():
            tp = part.tp
            try:
                if tp in ask:
                    _lo, hi = self.consumer.get_watermark_offsets(KTP(tp.topic, tp.partition),
                                                                  timeout=LAG_QUERY_TIMEOUT_S, cached=False)
                    part.live_high = hi
                else:
                    _lo, hi = self.consumer.get_watermark_offsets(KTP(tp.topic, tp.partition), cached=True)
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
            self.metrics.gauge("consumer_lag", lag, topic=tp.topic, partition=str(tp.partition))
        self.metrics.gauge("drain_seconds", self._drain.estimate(total, now))
        self.intake.report_unknown_lanes(self.metrics)
        if not self._broker_ok:
            # Nothing says when brokers are back while nothing arrives (an idle worker): ask for metadata.
            try:
                self.consumer.list_topics(timeout=1.0)
                self._broker_ok = True
                log.info("broker reachable again")
            except KafkaException:
                pass
        if self.health is not None:
            self.health.broker_reachable = self._broker_ok

    # ------------------------------------------------------------------ backpressure
    def _backpressure(self) -> None:
        in_flight = self.tracker.in_flight()
        self.metrics.gauge("in_flight", in_flight)
        bound = self.cfg.batching.max_in_flight
        span_bound, ratio = self.cfg.batching.max_uncommitted, self.cfg.batching.resume_ratio
        with self.cv:
            full = self._full_lanes = self.scheduler.over_bound(self._full_lanes, ratio)
        lanes_of, default_lane = self.intake.topic_lanes, self.cfg.batching.default_lane
        # Only the partitions near their bound matter (a handful of len() calls per turn otherwise).
        tracker, low = self.tracker, span_bound * ratio
        parts = self.partitions
        assigned, paused = parts.assigned, parts.paused
        spans = {tp: n for tp in assigned if (n := tracker.span(tp)) > low}
        want, self._holding, span_held = partitions_to_pause(
            in_flight=in_flight, bound=bound, resume_ratio=ratio, assigned=assigned, holding=self._holding,
            reached=parts.reached if self.stop_at is not None else set(), full_lanes=full,
            lane_of=lambda tp: lanes_of.get(tp.topic, default_lane), spans=spans, span_bound=span_bound,
            span_held=parts.span_held)
        parts.set_span_held(span_held)
        for tp, n in spans.items():
            if n >= span_bound and tp not in paused:
                log.warning("partition paused: %d records read since its oldest unfinished record (offset %s), "
                            "batching.max_uncommitted=%d", n, tracker.first_pending(tp), span_bound,
                            extra={"topic": tp.topic, "partition": tp.partition})
        if want != paused:
            to_pause = want - paused
            to_resume = (paused - want) & assigned
            if to_pause:
                self.consumer.pause([KTP(t, p) for t, p in to_pause])
            if to_resume:
                resumed = [KTP(t, p) for t, p in to_resume]
                self.consumer.resume(resumed)
                self._wake_fetcher(resumed)
            parts.set_paused(to_pause)
            parts.set_paused(paused - want, False)
            self.metrics.gauge("paused_partitions", len(want))
            log.debug("backpressure: %d partitions paused (in flight %d, bound %d)", len(want), in_flight, bound)

    def _wake_fetcher(self, parts: list[KTP]) -> None:
        """librdkafka does not wake a broker thread that had nothing left to fetch when its partitions are
        resumed: their first fetch waited for its next wake-up, 0.9 s on average (a bare consumer paused and
        resumed every 12,000 records read 15k records/s; with this, 150-200k/s: ``tests/bench/resume_fetch``).
        Seeking a resumed partition to its own position, which is where the fetch resumes anyway, wakes its
        broker thread. A partition without a position (nothing read since it was assigned or rewound) is left
        as it is: its fetch starts where librdkafka decides, at most a wake-up later."""
        try:
            positions = self.consumer.position(parts)
        except KafkaException as e:
            log.debug("no positions to wake the fetcher: %s", e)
            return
        for k in positions:
            if k.offset < 0:
                continue
            try:
                self.consumer.seek(k)
            except KafkaException as e:  # e.g. revoked meanwhile: nothing to wake
                log.debug("could not wake the fetcher of %s[%d]: %s", k.topic, k.partition, e)

    # ------------------------------------------------------------------ commits
    def _commit(self, only: set[TopicPartition] | None = None, sync: bool = True, flush_s: float = 30.0,
                step: bool = True) -> None:
        """Commit the done prefix. ``sync=False`` (the periodic commit): the request is sent and the loop goes
        on; ``_on_commit`` records the outcome when poll() serves it. A synchronous commit held the loop for a
        broker round trip every ``commit_interval_ms``, and every result finished meanwhile waited (the p99
        at light load). Revoke and shutdown commit synchronously: the partitions are handed over after.
        ``step=False``: a shutdown drain's turn, whose poll() tracks nothing (never step over markers)."""
        self._last_commit = time.monotonic()
        if self._no_commit:
            return
        if self.lifecycle.shutdown is not None:
            # Stopping: no flush waits past the shutdown deadline (the pod's grace period is counted from it).
            flush_s = self.lifecycle.shutdown.cap(flush_s, 1.0)
        # The loop's periodic commit only: every message the consumer returned has been tracked by now. Inside a
        # rebalance callback, consume() may hold fetched messages it has not returned yet while the position
        # already counts them.
        periodic = step and not sync and only is None and self.stop_at is None
        if self.txn is not None:
            self._checkpoint_transaction(flush_s, step=periodic)
            return
        offsets = self.tracker.committable()
        if periodic:
            self._step_over_markers(offsets)
        if only is not None:
            offsets = {tp: o for tp, o in offsets.items() if tp in only}
        if not offsets:
            return
        if not sync and offsets == self._commit_in_flight:
            return  # the same offsets are already on their way
        t0 = time.monotonic()
        try:
            self.consumer.commit(offsets=[KTP(tp.topic, tp.partition, o) for tp, o in offsets.items()],
                                 asynchronous=not sync)
        except KafkaException as e:
            # A rebalance in progress or a fenced generation shows up here (asynchronously: only local errors,
            # e.g. not in a group any more); the new owner starts from the last successful commit.
            self._commit_failed(e)
            return
        if sync:
            self._committed(offsets, t0)
        else:
            self._commit_in_flight = offsets
            self._commit_sent_at = t0

    def _step_over_markers(self, offsets: dict[TopicPartition, int]) -> None:
        """Where a partition has nothing unfinished, commit the consumer's position when it is past the tracker's
        offset. librdkafka moves the position over transaction markers (and aborted records), which never reach
        the worker: on input written by a transactional producer the commit otherwise stays one short of the
        end for good, a lag of 1 per partition that keeps KEDA from scaling to zero and an HPA from seeing an
        idle replica. Not in backfill (``stop_at``): records past its end are skipped untracked on purpose.

        A partition of which this assignment tracked nothing (a handover, a restart, a group whose commit sits on a
        marker) takes any valid position: librdkafka invalidates it on assign and seek (a rewind) and moves it
        only when it serves a message, which the loop has tracked by now, or a marker."""
        tracker = self.tracker
        idle = [tp for tp in self.partitions.assigned if tracker.span(tp) == 0]
        if not idle:
            return
        try:
            positions = self.consumer.position([KTP(tp.topic, tp.partition) for tp in idle])
        except KafkaException:
            return
        for k in positions:
            tp = TopicPartition(k.topic, k.partition)
            base = offsets.get(tp)
            if base is None:
                base = tracker.committed(tp)
            if base is None:
                # Nothing tracked: the position is valid only once a marker was served. Not again what this
                # worker committed last (the tracker keeps no commit for a partition it tracked nothing of).
                if k.offset >= 0 and k.offset != self.partitions.last_commit(tp):
                    offsets[tp] = k.offset
            elif k.offset > base:
                offsets[tp] = k.offset

    def _on_commit(self, err: Any, partitions: list[Any]) -> None:
        """librdkafka's report of a commit (served inside poll, on the loop thread). It reports synchronous
        commits too; those were accounted for by ``_commit`` already."""
        if self._commit_in_flight is None:
            return
        self._commit_in_flight = None
        if err is not None:
            self._commit_failed(err)
            return
        done = {tp: k.offset for k in partitions
                if k.error is None and k.offset >= 0 and self.partitions.is_assigned(tp := TopicPartition(k.topic, k.partition))}
        if done:
            self._committed(done, self._commit_sent_at)

    def _committed(self, offsets: dict[TopicPartition, int], sent_at: float) -> None:
        self.tracker.mark_committed(offsets)
        self.partitions.set_committed(offsets)
        self.stats.commits += 1
        self._broker_ok = True
        self.metrics.gauge("commit_seconds", time.monotonic() - sent_at)

    def _commit_failed(self, err: Any) -> None:
        # Not fatal: the same (or a later) prefix is committed next time.
        log.warning("commit failed: %s", err)
        self.metrics.event("commit_failures")

    def _abort_for_failed_delivery(self) -> None:
        log.warning("exactly-once: a result was not delivered (%s); aborting the transaction", self._abort_pending)
        self._abort_pending = None
        self._delivery_aborts += 1
        self._abort_transaction()

    def _checkpoint_transaction(self, flush_s: float = 30.0, step: bool = False) -> None:
        """``flush_s``: how long produced results may take to be delivered (a revoke or a shutdown passes what
        is left of its budget); later, the transaction is aborted and the records are read again. ``step``: the
        loop's periodic checkpoint, which may commit past transaction markers (``_step_over_markers``)."""
        assert self.txn is not None
        if self._abort_pending is not None:
            # librdkafka refuses to commit a transaction with a failed delivery (it must be aborted): abort now
            # rather than send a commit that fails and then abort anyway.
            self._abort_for_failed_delivery()
            return
        t0 = time.monotonic()
        # Every produced result must be delivered before its offset can go into the transaction.
        left = self.emitter.flush(flush_s)
        if left:
            # Committing now would commit those results (commit_transaction flushes them itself) without the
            # offsets that cover them: abort, and read again from the last commit.
            log.warning("exactly-once checkpoint: %d messages still undelivered after %.0f s; aborting", left,
                        flush_s)
            self._abort_transaction()
            return
        if self._abort_pending is not None:
            # A failure report served by that flush: the commit would fail (the transaction must be aborted).
            self._abort_for_failed_delivery()
            return
        offsets = self.tracker.committable()
        if step:
            self._step_over_markers(offsets)
        try:
            ok = self.txn.checkpoint(offsets)
        except TransactionFailed as e:
            self._fail(str(e))
            return
        if ok:
            self._delivery_aborts = 0
            self.tracker.mark_committed(offsets)
            self.partitions.set_committed(offsets)
            self.stats.commits += 1
            self.metrics.gauge("commit_seconds", time.monotonic() - t0)
        else:
            # The failed commit aborted the transaction, and with it any failed delivery reported meanwhile.
            self._abort_pending = None
            self.metrics.event("commit_failures")
            self._rewind()

    def _abort_transaction(self) -> None:
        """Abort the open transaction and read every assigned partition again from its last commit."""
        assert self.txn is not None
        try:
            self.txn.abort()
        except TransactionFailed as e:
            self._fail(str(e))
            return
        self._abort_pending = None  # the failed deliveries were in the aborted transaction
        self.metrics.event("commit_failures")
        self._rewind()

    def _rewind(self) -> None:
        """After an aborted transaction: forget everything in flight and read again from the committed
        offsets (results of the aborted transaction are invisible to read_committed readers)."""
        tps = set(self.partitions.assigned)
        with self.cv:
            self.scheduler.revoke(tps)
            self._suspects.clear()
        self.tracker.revoke(tps)
        if self.txn is not None:
            self.txn.drop(tps)
        first_read = self.partitions.rewind(tps)
        try:
            committed = retry_transient(self.consumer.committed, [KTP(t, p) for t, p in tps], timeout=30)
            for k in committed:
                tp = TopicPartition(k.topic, k.partition)
                # Without a commit: the first offset read since the assign (or the last rewind), where
                # auto.offset.reset or a backfill's start put the consumer; nothing read, nothing to seek.
                to = k.offset if k.offset >= 0 else first_read.get(tp)
                self.partitions.note_rewound(tp, to)
                if to is not None:
                    self.consumer.seek(KTP(k.topic, k.partition, to))
                    # Backfill: its end counts again once re-read (the seek brings the EOF event back).
                    self.partitions.unmark_reached(tp)
        except Exception as e:
            # The consumer would go on from its fetch position with nothing tracked before it, and the next
            # checkpoint would commit past records whose results the abort discarded (never visible). Commit
            # nothing more and exit 1: the next process starts from the committed offsets.
            self._no_commit = True
            self._fail(f"exactly-once: could not rewind to the committed offsets after an abort: {e}")
            log.error(self.lifecycle.fatal)
            return
        log.warning("rewound to the committed offsets after an aborted transaction", extra={"partitions": len(tps)})

    # ------------------------------------------------------------------ group membership
    def _while_current(self, made: list[Any], callback: Callable[..., None]) -> Callable[..., None]:
        """``callback`` for the consumer ``made[0]``, called only while it is the runner's consumer: a replaced
        one closes on a thread of its own, and what that close serves (revokes, commit reports, errors) must not
        touch the loop's state. By the object the runner holds, not the one librdkafka passes a rebalance
        callback: the runner may hold a wrapper (tests/bench/profile_worker.py times every call)."""

        def call(*args: Any) -> None:
            if made[0] is self.consumer:
                callback(*args)

        return call

    def _make_consumer(self) -> Any:
        made: list[Any] = []
        made.append(make_consumer(self.cfg, **{"group.id": self.group_id,
                                               "on_commit": self._while_current(made, self._on_commit),
                                               "error_cb": self._while_current(made, self._on_client_error)}))
        return made[0]

    def _subscribe(self) -> None:
        made = [self.consumer]
        self.consumer.subscribe(self.cfg.input_topics(), on_assign=self._while_current(made, self._on_assign),
                                on_revoke=self._while_current(made, self._on_revoke),
                                on_lost=self._while_current(made, self._on_lost))
        self._rejoin.out(time.monotonic())  # a member once its first assignment (an empty one too) comes

    def _replace_consumer(self, now: float) -> None:
        """The consumer has been out of its group longer than a rejoin can take (``kafka.rejoin_timeout_ms``):
        a new one subscribes in its place and the old one closes on another thread. Nothing is lost: the
        partitions were released when the assignment was lost, and the new member reads from the commits."""
        old = self.consumer
        log.error("the consumer has been out of its group for %.0f s (allowed: %.0f s, kafka.rejoin_timeout_ms): "
                  "replacing it with a new one", self._rejoin.out_for(now), self._rejoin.allowance_s,
                  extra={"group": self.group_id, "replacements": self._rejoin.replacements + 1})
        if self.partitions.assigned:
            self._release(set(self.partitions.assigned), graceful=False)
        self.consumer = self._make_consumer()
        if self.txn is not None:
            self.txn.consumer = self.consumer
        self._commit_in_flight = None  # its report would come from the old consumer, which reports nothing now
        self._subscribe()
        self._rejoin.replaced(now)
        self.metrics.event("rebalances", kind="replace")
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

    # ------------------------------------------------------------------ rebalance (loop thread, inside poll)
    def _on_assign(self, consumer: Any, partitions: list[KTP]) -> None:
        self._rejoin.joined()
        try:
            self.partitions.assign(TopicPartition(p.topic, p.partition) for p in partitions)
            self.metrics.event("rebalances", kind="assign")
            if self.health is not None:
                self.health.assigned = bool(self.partitions.assigned)
            log.info("partitions assigned", extra={"partitions": [f"{p.topic}[{p.partition}]" for p in partitions]})
            if self.tracker.lost():
                try:
                    self._resume_lost(consumer, partitions)
                except Exception:  # the hook, pause and resume below must still happen
                    log.exception("error in on_assign (resuming lost partitions)")
            if self._on_assign_offsets is not None:
                try:
                    self._on_assign_offsets(consumer, partitions)
                except Exception:  # the pause / resume below must still happen, or a paused partition stays so
                    log.exception("error in on_assign (choosing start offsets)")
            if partitions and self.lifecycle.stopping:
                # Assigned while shutting down (a peer left during the drain): nothing more is read, and the
                # drain's poll(0) would return its records only to drop them. Paused, it is committed where
                # its group left it and handed over on close.
                consumer.pause(partitions)
                self.partitions.set_paused(TopicPartition(p.topic, p.partition) for p in partitions)
            elif partitions:
                # librdkafka keeps a partition's pause through a revoke and a new assign: one paused (backpressure,
                # a backfill's end) when it was revoked came back paused, while the runner, which forgets what it
                # paused of a released partition, counted it as fetching. It was never read again by this worker.
                consumer.resume(partitions)
        except Exception:  # never let an exception escape a rebalance callback raw
            log.exception("error in on_assign")

    def _resume_lost(self, consumer: Any, partitions: list[KTP]) -> None:
        """At-least-once: partitions this worker lost (its session expired, or it replaced its consumer) come back
        to it. What it delivered of them since its last commit was never committed: read from the group's
        commit, all of it would be processed and produced a second time (after a broker restart: thousands of
        records, device time spent on answers the output topic already has). In the first assignment after the
        loss (the rejoin's; what other partitions left is dropped then), where the group's commit is still
        inside what this worker tracked of the partition and short of the offset up to which it delivered every
        record (results delivered after the loss count too), that offset is committed now, before librdkafka
        fetches the commit to start from, and reading goes on there.

        Safe: every record below it has a result on the output topic, which is the guarantee (per record, not per
        consumer). A commit outside that range is left alone: another member committed further; the offsets
        were reset below what this worker read (an operator's rewind is honoured); the partition has no commit
        and its log no longer spans what this worker read (a recreated topic). Exactly-once never gets here: a
        lost partition's transaction is aborted, so nothing it produced is visible."""
        held: dict[TopicPartition, tuple[int, int]] = {}
        for p in partitions:
            tp = TopicPartition(p.topic, p.partition)
            span = self.tracker.take_lost(tp)
            if span is not None:
                held[tp] = span
        # Only the assignment that follows the loss (the rejoin's) may use what it left. A partition that went to
        # another member comes back, if ever, after that member committed what it did; meanwhile its offsets
        # may have been reset or its topic recreated, and what this worker read then says nothing of them.
        self.tracker.forget_lost()
        if not held or self.lifecycle.stopping:
            return
        deadline = Deadline(RESUME_QUERY_TIMEOUT_S)  # for all the reads together
        try:
            group = consumer.committed([KTP(tp.topic, tp.partition) for tp in held], timeout=RESUME_QUERY_TIMEOUT_S)
        except KafkaException as e:
            log.warning("partitions lost earlier are back, but their commits could not be read (%s): reading on "
                        "from the commits, so what was delivered since them is processed again", e)
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
            log.warning("partitions lost earlier are back, but committing what this worker delivered of them failed "
                        "(%s): reading on from the commits, so that is processed again", e)
            return
        self.partitions.set_committed(moves)
        self.metrics.event("lost_records_skipped", n=sum(skipped.values()))
        log.info("partitions lost earlier are back: going on after the records this worker already delivered",
                 extra={"skipped": skipped, "resume_at": {f"{tp.topic}[{tp.partition}]": off
                                                          for tp, off in moves.items()}})

    @staticmethod
    def _still_holds(consumer: Any, k: KTP, first: int, done: int, timeout: float) -> bool:
        """A partition without a commit still holds the offsets ``[first, done)`` this worker read. Why: without
        a commit nothing tells a partition whose topic was deleted and created again (its offsets now other
        records) from the one this worker read; a new log short of ``done``, or not reaching back to
        ``first``, is not taken for it. No answer within ``timeout`` (what is left of the reads' 5 s): not taken."""
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
            self._release(tps, graceful=self.lifecycle.fatal is None)
            self.metrics.event("rebalances", kind="revoke")
        except Exception as e:
            log.exception("error in on_revoke")
            self._fatal_if_refused(e)
            # The partitions are gone whatever failed (waiting, flushing, committing): forget them, or their
            # dropped records stay "in flight" for good (backpressure) and their late outputs get produced.
            try:
                self._release(tps, graceful=False)
            except Exception as e2:
                log.exception("error releasing the revoked partitions")
                self._fatal_if_refused(e2)

    def _on_lost(self, consumer: Any, partitions: list[KTP]) -> None:
        self._rejoin.out(time.monotonic())
        try:
            tps = {TopicPartition(p.topic, p.partition) for p in partitions}
            self._release(tps, graceful=False)
            self.metrics.event("rebalances", kind="lost")
        except Exception as e:
            log.exception("error in on_lost")
            self._fatal_if_refused(e)

    def _fatal_if_refused(self, e: Exception) -> None:
        """A message the producer refuses ends the worker (exit 1), raised in a loop turn or while serving results
        inside a rebalance callback (which must not swallow it)."""
        if isinstance(e, FatalDeliveryError) and self.lifecycle.fatal is None:
            if self._abortable(e):
                self._abort_pending = str(e)  # the release that follows aborts the transaction (and clears it)
            else:
                self._fail(str(e))
                if self.txn is not None:
                    # The open transaction may hold part of what the refused record owes (its error result, its
                    # dead letter refused): committed, that would be visible while the record's offset is not,
                    # and the restart would produce it again. Commit nothing more: closing aborts it.
                    self._no_commit = True

    def _release(self, tps: set[TopicPartition], graceful: bool) -> None:
        """Revoke: queued records of these partitions are dropped (not yet started: the new owner will
        process them); records already on a device get ``revoke_timeout_ms`` to finish and be delivered;
        what is done is committed synchronously; the rest is dropped."""
        with self.cv:
            dropped = list(self.scheduler.revoke(tps))
            dropped += [r for r in self._suspects if r.tp in tps]
            self._suspects = deque(r for r in self._suspects if r.tp not in tps)
        dropped_per: Counter[TopicPartition] = Counter(r.tp for r in dropped)
        if graceful:
            # The revoke of consumer.close() after a shutdown: what could finish had shutdown_timeout_s.
            deadline = Deadline(self.cfg.delivery.revoke_timeout_ms / 1000.0).within(self.lifecycle.shutdown)
            # Nothing at or after a partition's first dropped record can be committed now (nor, in exactly-once
            # mode, produced: it waits in the reorder buffer behind it), so only the records before it count.
            first_dropped = {tp: min(r.offset for r in dropped if r.tp == tp) for tp in dropped_per}
            txn = self.txn

            def settled(tp: TopicPartition) -> bool:
                if txn is not None:
                    # Exactly-once: enough once every record before the first dropped one has been produced
                    # (it left the reorder buffer); the checkpoint below flushes and commits them. Waiting for
                    # the one transactional producer to drain never ends while other partitions keep producing.
                    q = txn.order.get(tp)
                    head = q[0] if q else None
                    return head is None or head >= first_dropped.get(tp, head + 1)
                oldest = self.tracker.first_pending(tp)
                return oldest is None or oldest >= first_dropped.get(tp, oldest + 1)

            while not deadline.expired():
                if all(settled(tp) for tp in tps):
                    break
                self._serve_results(0.005, time.monotonic())
            if txn is None:
                self.emitter.flush(deadline.left())
            self._commit(only=tps, flush_s=deadline.left(1.0))
            self.gate.flush()  # the results that flush confirmed: the new owner's ledger skips them
        if graceful or self.txn is not None:
            self.tracker.revoke(tps)
        else:
            # Lost (nothing could be committed): what this worker delivered of them is kept, and the results still
            # on their way go on marking records done, for when the partitions come back (_resume_lost).
            self.tracker.detach(tps)
        if self.txn is not None:
            self.txn.drop(tps)
        self.partitions.release(tps)
        for tp in tps:
            # The Prometheus adapter keeps a gauge's last value per label set: a released partition's lag
            # would stay on /metrics (and in the total lag the autoscaler reads) until the process exits.
            self.metrics.remove_lag(tp.topic, tp.partition)
        if self.txn is not None and not graceful:
            # The open transaction holds results of these partitions, whose offsets it can no longer commit
            # (the new owner produces them again): committed later, they would be visible twice. Abort it and
            # read the partitions kept again from their last commit.
            self._abort_transaction()
        log.info("partitions released", extra={"partitions": sorted(f"{t}[{p}]" for t, p in tps),
                                               "dropped_queued": len(dropped), "graceful": graceful})

    # ------------------------------------------------------------------ backfill
    def _backfill_complete(self) -> bool:
        assert self.stop_at is not None
        return self.partitions.reached.issuperset(self.stop_at) and self.tracker.in_flight() == 0

    # ------------------------------------------------------------------ shutdown
    def _shutdown(self) -> int:
        """Stop fetching, finish in-flight work within shutdown_timeout_s, commit. 0 unless a fatal error."""
        log.info("shutting down", extra={"in_flight": self.tracker.in_flight()})
        assigned = self.partitions.assigned
        if assigned:
            self.consumer.pause([KTP(t, p) for t, p in assigned])
            self.partitions.set_paused(assigned)
        with self.cv:
            self.scheduler.flush(time.monotonic())
            self.cv.notify_all()
        deadline = self.lifecycle.drain(self.cfg.delivery.shutdown_timeout_s)
        if self.txn is not None:
            self.txn.deadline = deadline
        while self.tracker.in_flight() > 0 and not deadline.expired() and self.lifecycle.fatal is None:
            self._iterate(consume=False)
            time.sleep(0.001)
        if self.txn is None:  # a checkpoint flushes itself
            self.emitter.flush(deadline.left(1.0))
        self._commit(flush_s=deadline.left(1.0))
        # What the last flush confirmed goes into the ledger now (a loop turn records it; no turn comes after):
        # results behind an unfinished record are covered by no commit, only by the ledger after a restart.
        self.gate.flush()
        left = self.tracker.in_flight()
        if left:
            log.warning("shutdown timeout: records left uncommitted (they will be reprocessed)", extra={"count": left})
        self.intake.report_unknown_lanes(self.metrics)  # what came since the last lag report
        if self.lifecycle.fatal:
            log.error(self.lifecycle.fatal)
            return 1
        return 0

    def _close(self) -> None:
        self.lifecycle.close()  # device threads stop asking for batches
        with self.cv:
            self.cv.notify_all()
        # All devices stop at once and share one 5 s budget (one after the other, each had 5 s).
        for w in self.workers:
            w.request_stop()
        stop_by = Deadline(5.0)
        for w in self.workers:
            try:
                w.stop(timeout=stop_by.left())
            except Exception:
                log.exception("stopping device worker")
        if self.consumer is not None:
            try:
                self.consumer.close()  # leaves the group now (no session-timeout wait for the others)
            except Exception:
                log.exception("closing consumer")
        # Both producers share one 5 s budget: with the broker gone each flush would wait it out in turn, and a
        # stop must fit in the pod's grace period (shutdown_timeout_s + a 15 s margin in the chart).
        flush_by = Deadline(5.0)
        if self.producer is not None and self.txn is not None:
            self.txn.close()
        # The emitter's producers: one may have replaced a stalled one (whose purge left nothing to flush). No
        # emitter when run() stopped before making it.
        emitter = getattr(self, "emitter", None)
        producers = [s.producer for s in emitter.slots] if emitter is not None else [self.producer, self.spare_producer]
        for producer in producers:
            if producer is not None:
                producer.flush(flush_by.left())
