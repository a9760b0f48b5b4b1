"""The one loop that wires the ports together (docs/architecture.md, "The loop").

Threads:
- the **loop thread** (the caller of ``Runner.run``) owns every Kafka client call: consume, produce, poll,
  commit, pause/resume and the rebalance callbacks;
- one **device thread** per device (``DeviceWorker``) takes the next batch from ``Dispatch``, runs the
  model and hands the outputs back through ``Dispatch.completions``.

Each kind of state has one owner in ``worker/pipeline/``: the partitions (``PartitionTable``), the phase
and the stop budgets (``Lifecycle``), the queues and devices (``Dispatch``), how results and offsets reach
Kafka (``DeliveryMode``: at-least-once or exactly-once, chosen once), the group membership
(``Membership``), reading (``Ingest``), results (``Results``), pauses (``FlowControl``) and lag
(``LagReport``). The optional store (ledger, cache, attempt counters) is in ``StoreGate``.
"""

from __future__ import annotations

import functools
import gc
import logging
import signal
import time
from collections.abc import Callable
from typing import Any, cast

from confluent_kafka import TopicPartition as KTP

from worker.config.settings import Config
from worker.core.offsets import OffsetTracker
from worker.core.ports import Metrics, Model, NullMetrics, Store
from worker.core.records import TopicPartition
from worker.core.scheduler import PriorityScheduler
from worker.kafka.clients import make_consumer, make_producer
from worker.output.emit import Emitter, FatalDeliveryError
from worker.pipeline.context import Loop, RunStats
from worker.pipeline.delivery import AtLeastOnce, DeliveryMode
from worker.pipeline.dispatch import Dispatch
from worker.pipeline.exactly_once import DELIVERY_ABORTS_MAX, ExactlyOnce
from worker.pipeline.flow import FlowControl
from worker.pipeline.ingest import Ingest
from worker.pipeline.intake import Intake
from worker.pipeline.lag import LagReport
from worker.pipeline.lifecycle import Lifecycle
from worker.pipeline.membership import Membership
from worker.pipeline.partitions import PartitionTable
from worker.pipeline.results import Results
from worker.pipeline.store_gate import StoreGate
from worker.timing.clock import Deadline, LoopClock

__all__ = ["DELIVERY_ABORTS_MAX", "GC_THRESHOLD", "RunStats", "Runner"]

log = logging.getLogger("worker.runner")
# Records are acyclic and freed by reference counting; young-generation passes every 700 allocations (the
# default) only burn CPU on the hot path.
GC_THRESHOLD = (20_000, 20, 20)


class Runner:
    def __init__(self, cfg: Config, model: Model | None = None, *, metrics: Metrics | None = None,
                 store: Store | None = None, devices: list[str] | None = None,
                 stop_at: dict[TopicPartition, int] | None = None,
                 on_assign_offsets: Callable[[Any, list[KTP]], None] | None = None,
                 group_id: str | None = None, install_signals: bool = False,
                 health: Any = None, reached: set[TopicPartition] | None = None,
                 spare_producer: bool = True, clock: LoopClock = time,
                 new_consumer: Callable[..., Any] = make_consumer,
                 new_producer: Callable[..., Any] = make_producer,
                 load_devices: Callable[[Dispatch], list[tuple[Model, Any]]] | None = None) -> None:
        """``clock``: where the loop reads the time (and sleeps). ``new_consumer(cfg, **props)`` and
        ``new_producer(cfg, **props)`` make the Kafka clients (each called again for a replacement).
        ``load_devices(dispatch)``: the model and the device worker of each device, the worker taking its
        batches from ``dispatch``; by default one torch engine per device of the config."""
        self.cfg = cfg
        self.clock = clock
        self._new_consumer = new_consumer
        self._new_producer = new_producer
        self._load_devices = load_devices
        self.metrics: Metrics = metrics or NullMetrics()
        self.health = health
        self._models: list[Model] = []
        self._model_arg = model
        self._device_specs = devices
        self.stop_at = stop_at  # backfill: stop when every partition reaches these end offsets
        self._on_assign_offsets = on_assign_offsets
        self.group_id = group_id or cfg.kafka.group_id
        self._want_spare = spare_producer  # at-least-once only: see Emitter
        self.lifecycle = Lifecycle(clock)
        self.ready = self.lifecycle.ready  # set once the clients are made and subscribed
        self.stats = RunStats(started=clock.monotonic())
        self.partitions = PartitionTable(reached or ())
        self.scheduler = PriorityScheduler(cfg.batching.lanes, cfg.batching.default_lane, cfg.batching.policy,
                                           cfg.batching.bucket_width)
        self.gate = StoreGate(store, cfg, self.stats, self.metrics)
        self.dispatch = Dispatch(self.scheduler, self.partitions, self.lifecycle, self.gate, self.metrics,
                                 clock=clock)
        self.loop = Loop(cfg=cfg, metrics=self.metrics, stats=self.stats, lifecycle=self.lifecycle,
                         partitions=self.partitions, tracker=OffsetTracker(), gate=self.gate,
                         dispatch=self.dispatch, health=health, stop_at=stop_at, clock=clock)
        self.lag = LagReport(self.loop)
        self.flow = FlowControl(self.loop)
        self.workers: list[Any] = []
        # Made by run(), once the model is loaded.
        self.mode: DeliveryMode
        self.results: Results
        self.ingest: Ingest
        self.membership: Membership
        self.emitter: Emitter
        self.intake: Intake
        if install_signals:
            # Now, not in run(): a SIGTERM while the model loads (seconds to minutes) must stop the worker
            # gracefully, not kill it with the default disposition.
            signal.signal(signal.SIGTERM, self.stop)
            signal.signal(signal.SIGINT, self.stop)

    # ------------------------------------------------------------------ what callers read
    @property
    def tracker(self) -> OffsetTracker:
        return self.loop.tracker

    @tracker.setter
    def tracker(self, tracker: OffsetTracker) -> None:  # a subclass counts what it tracks (backfill)
        self.loop.tracker = tracker

    @property
    def consumer(self) -> Any:
        return self.loop.consumer

    @property
    def producer(self) -> Any:
        return self.mode.producer if hasattr(self, "mode") else None

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

    @property
    def models_loaded(self) -> bool:
        return self.lifecycle.models_loaded

    # ------------------------------------------------------------------ setup
    def _build_models(self) -> None:
        pairs = self._load_devices(self.dispatch) if self._load_devices is not None else self._torch_devices()
        self._models = [m for m, _ in pairs]
        self.workers = [w for _, w in pairs]
        self.dispatch.devices(len(self.workers))
        self.model = self._models[0]
        self.lifecycle.loaded()
        self.metrics.gauge("model_loaded", 1)
        if self.health is not None:
            self.health.model_loaded = True

    def _torch_devices(self) -> list[tuple[Model, Any]]:
        from worker.device.engine import DeviceWorker, Engine, resolve_device
        from worker.models.registry import load_model

        specs = self._device_specs or self.cfg.model.devices or [self.cfg.model.device]
        devices = [resolve_device(s) for s in specs]
        if self._model_arg is not None and len(devices) > 1:
            # One handler object cannot be set up on several devices, and the others would load cfg.model,
            # which may be another model: results would depend on the device a batch happened to run on.
            raise ValueError(f"Runner(model=...) runs one device, but the config lists {len(devices)} "
                             f"({', '.join(devices)}): pass no model (each device loads model.name) "
                             "or one device")
        dispatch, mcfg = self.dispatch, self.cfg.model
        limits = {lane.name: lane.max_batch_size for lane in self.cfg.batching.lanes}
        pairs: list[tuple[Model, Any]] = []
        budgets = {lane.name: lane.max_batch_tokens for lane in self.cfg.batching.lanes}
        # Cached outputs stay the handler's lists: a worker with another encoding may send them.
        packed = "lists" if self.cfg.redis.cache else self.cfg.delivery.outputs_encoding
        for i, dev in enumerate(devices):
            model = self._model_arg if (i == 0 and self._model_arg is not None) else load_model(mcfg)
            if getattr(model, "kind", None) == "generative":  # its own worker (worker.pipeline.generation)
                from worker.pipeline.generation import attach

                gen = attach(model, dev, self.cfg, dispatch, len(pairs))
                pairs.append((cast(Model, gen.model), gen))  # intake reads its decode, name, version
                continue
            engine = Engine(model, dev, dtype=mcfg.dtype, compile=mcfg.compile, warmup=mcfg.warmup,
                            on_limit=dispatch.on_limit, max_batch_sizes=limits,
                            on_tokens=dispatch.on_tokens, max_batch_tokens=budgets,
                            host_threads=mcfg.host_threads, outputs_encoding=packed)
            engine.setup()
            w = len(pairs)
            pairs.append((model, DeviceWorker(engine, take=functools.partial(dispatch.take, worker=w),
                                              done=functools.partial(dispatch.done, worker=w),
                                              swap=dispatch.swap, name=f"device-{dev}")))
        # Hundreds of thousands of long-lived objects (torch, the model) would otherwise be walked by every
        # full garbage collection, which the per-record allocations trigger every few thousand records.
        gc.collect()
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLD)
        return pairs

    def _open(self) -> None:
        """Intake, consumer, producers (through the delivery mode) and emitter, in that order."""
        cfg, loop = self.cfg, self.loop
        self.intake = loop.intake = Intake(cfg, self.model, route=self.scheduler.lane_for, clock=self.clock)
        new_producer = self._new_producer
        self.mode = (ExactlyOnce(loop, new_producer, self.group_id) if cfg.delivery.mode == "exactly_once"
                     else AtLeastOnce(loop, new_producer, spare=self._want_spare))
        self.results = Results(loop, self.mode)
        self.ingest = Ingest(loop, self.mode, self.results)
        self.membership = Membership(loop, self.mode, self.results, group_id=self.group_id,
                                     new_consumer=self._new_consumer,
                                     on_client_error=self.lag.on_client_error,
                                     on_assign_offsets=self._on_assign_offsets)
        loop.consumer = self.membership.make_consumer()
        self.mode.open()
        self.emitter = loop.emitter = Emitter(
            self.mode.producer, cfg.kafka.output_topic, cfg.kafka.dlq_topic,
            getattr(self.model, "name", "model"), cfg.model.version or getattr(self.model, "version", None),
            cfg.delivery.format, on_done=self.results.record_done, on_failed=self.results.record_failed,
            on_done_many=self.results.records_done,
            is_stale=lambda r: not self.partitions.is_current(r),
            max_message_bytes=int(cfg.kafka.producer.get("message.max.bytes", 1_000_000)),
            spare_producer=self.mode.spare_producer, on_wait=self._beat,
            stall_s=cfg.delivery.producer_stall_s, outputs_encoding=cfg.delivery.outputs_encoding,
            on_replace=lambda: self.metrics.event("producer_replacements"), clock=self.clock,
            **self.mode.emitter_options())

    # ------------------------------------------------------------------ the loop
    def stop(self, *_: Any) -> None:
        """Ask for a graceful stop (signal-safe)."""
        self.lifecycle.request_stop()
        self.dispatch.wake()

    def start(self) -> bool:
        """Loads the models, makes the clients, starts the devices and joins the group: what ``run`` does
        before its first turn. False when a stop came during the model load (no clients made then)."""
        self._build_models()
        if self.lifecycle.stop_requested:
            # A stop asked for while the model loaded (which can take minutes): no clients, no group join.
            log.info("stopped during the model load")
            return False
        self._open()
        for w in self.workers:
            w.start()
        self.lag.check_broker()
        self.membership.subscribe()
        if self.health is not None:
            self.health.waiting_for_assignment = True
        log.info("worker started", extra={"topics": self.cfg.input_topics(), "group": self.group_id,
                                          "devices": [w.name for w in self.workers]})
        self.ready.set()
        return True

    def run(self) -> int:
        if not self.start():
            return 0
        try:
            while self.lifecycle.running:
                self.step()
                if self.loop.backfill_complete():
                    break
            return self.shutdown()
        finally:
            self.close()

    def step(self, consume: bool = True) -> None:
        """One loop turn. A message the producer refuses ends the turn and fails the lifecycle: the run loop
        and the shutdown drain both stop on it."""
        try:
            self.turn(consume)
        except FatalDeliveryError as e:
            self.mode.on_refused(e)
        self.mode.end_of_turn()
        self._watch_devices()

    def turn(self, consume: bool = True) -> None:
        """``consume=False``: a shutdown drain's turn (every partition paused; nothing is read)."""
        now = self.clock.monotonic()
        self._heartbeat(now)
        if consume:
            self._keep_membership(now)
            self.ingest.poll()
        else:
            self._serve_callbacks()
        self.results.serve(0.0, now)
        self.gate.flush()
        if self.lag.due(now):
            self.lag.report(now)
        if consume:
            self.flow.apply()
        if self.mode.commit_due(self.clock.monotonic()):
            self.mode.commit(sync=False, step=consume)

    def _heartbeat(self, now: float) -> None:
        if self.health is not None:
            self.health.heartbeat = now

    def _keep_membership(self, now: float) -> None:
        if self.membership.rejoin.due(now):
            self.membership.replace_consumer(now)

    def _serve_callbacks(self) -> None:
        # Heartbeats / rebalance callbacks while draining. Every partition is paused, so this returns no
        # record; one it did return anyway is not tracked, and the drain's commits neither step over markers
        # (which would commit the position past it) nor reach it through the tracker.
        self.consumer.poll(0)

    def _watch_devices(self) -> None:
        batch_timeout = self.cfg.model.batch_timeout_s
        for w in self.workers:
            if batch_timeout and self.lifecycle.fatal is None:
                busy = w.busy_for(self.clock.monotonic())
                if busy > batch_timeout:
                    # The threads are alive and the heartbeat is fresh, but this batch will not come back: its
                    # partitions would stay unprocessed for good. Restarting is the way out (the attempt
                    # counters, with Redis, quarantine a record that hangs every time).
                    self.lifecycle.fail(f"{w.name}: a batch has been on the device for {busy:.0f} s "
                                        f"(model.batch_timeout_s={batch_timeout:g}); its records are not "
                                        "committed and are processed again after a restart")
            err = w.error
            if err is not None and self.lifecycle.fatal is None:
                # A thread of its pipeline died (a handler raised SystemExit, say): the batches it held never
                # come back, and waiting for them would stall the worker with a healthy heartbeat.
                self.lifecycle.fail(f"{w.name}: a device pipeline thread failed ({type(err).__name__}: "
                                    f"{err}); its records are not committed and are processed again after a "
                                    "restart")

    def _beat(self) -> None:
        """The loop is alive while it waits for room in the producer's full queue (up to message.timeout.ms,
        120 s by default): /healthz must not fail a worker that is only waiting for a slow broker."""
        if self.health is not None:
            self.health.beat()

    # ------------------------------------------------------------------ shutdown
    def shutdown(self) -> int:
        """Stop fetching, finish in-flight work within shutdown_timeout_s, commit. 0 unless a fatal error."""
        log.info("shutting down", extra={"in_flight": self.tracker.in_flight()})
        assigned = self.partitions.assigned
        if assigned:
            self.consumer.pause([KTP(t, p) for t, p in assigned])
            self.partitions.set_paused(assigned)
        self.dispatch.flush(self.clock.monotonic())
        deadline = self.lifecycle.drain(self.cfg.delivery.shutdown_timeout_s)
        self.mode.stopping(deadline)
        while self.tracker.in_flight() > 0 and not deadline.expired() and self.lifecycle.fatal is None:
            self.step(consume=False)
            self.clock.sleep(0.001)
        self.mode.flush(deadline.left(1.0))
        self.mode.commit(flush_s=deadline.left(1.0))
        # What the last flush confirmed goes into the ledger now (a loop turn records it; no turn comes
        # after): results behind an unfinished record are covered by no commit, only by the ledger after a
        # restart.
        self.gate.flush()
        left = self.tracker.in_flight()
        if left:
            log.warning("shutdown timeout: records left uncommitted (they will be reprocessed)",
                        extra={"count": left})
        self.intake.report_unknown_lanes(self.metrics)  # what came since the last lag report
        if self.lifecycle.fatal:
            log.error(self.lifecycle.fatal)
            return 1
        return 0

    def close(self) -> None:
        self.lifecycle.close()  # device threads stop asking for batches
        self.dispatch.wake()
        # All devices stop at once and share one 5 s budget.
        for w in self.workers:
            w.request_stop()
        stop_by = Deadline(5.0, self.clock)
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
        # Both producers share one 5 s budget: with the broker gone each flush would wait it out in turn, and
        # a stop must fit in the pod's grace period (shutdown_timeout_s + a 15 s margin in the chart).
        flush_by = Deadline(5.0, self.clock)
        mode = getattr(self, "mode", None)
        if mode is not None and mode.producer is not None:
            mode.close()
        # The emitter's producers: one may have replaced a stalled one (whose purge left nothing to flush). No
        # emitter when run() stopped before making it.
        emitter = getattr(self, "emitter", None)
        producers = ([s.producer for s in emitter.slots] if emitter is not None else
                     [mode.producer, mode.spare_producer] if mode is not None else [])
        for producer in producers:
            if producer is not None:
                producer.flush(flush_by.left())
