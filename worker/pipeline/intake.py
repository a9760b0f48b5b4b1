"""Turns a consumed Kafka message into a routed Record, or into an Outcome when it cannot be processed.

Order of checks (cheapest first, nothing raises): size limit -> wire decode + schema validation into
``Request[model.input_type]`` -> lane routing -> deadline -> the model's own ``decode``. A rejection
becomes an Outcome with ``dlq_stage`` set; when the request's id could still be read, the requester
also gets an ``error`` result.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from schemas import H_PRIORITY, Request
from worker.config.settings import Config
from worker.core.ports import Metrics, Model
from worker.core.records import Outcome, Record
from worker.core.scheduler import PriorityScheduler
from worker.output.result_encoding import UNENCODABLE
from worker.store.memory_store import cache_key
from worker.timing.clock import LoopClock

log = logging.getLogger("worker.intake")
UNKNOWN_NAMES_LOGGED = 5  # lane names quoted per warning (they come from clients: any number of them)


class _IdOnly(msgspec.Struct):
    id: str


_id_json = msgspec.json.Decoder(_IdOnly)
_id_msgpack = msgspec.msgpack.Decoder(_IdOnly)
_cache_input = msgspec.msgpack.Encoder(order="sorted")  # canonical bytes: equal inputs, equal keys


def salvage_id(value: bytes, fmt: str) -> str | None:
    """Best effort: the id of a request that failed validation, so its sender can get an error result."""
    try:
        return (_id_json if fmt == "json" else _id_msgpack).decode(value).id
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
        # RecursionError: the request failed validation on an early field, and nests past the decoder's depth
        # limit after it (the main decode stopped before reaching that depth; this one skips over it).
        return None


class Intake:
    def __init__(self, cfg: Config, model: Model,
                 route: Callable[[str, str | None, str | None, dict[str, str]],
                                 tuple[str, bool]] | None = None, clock: LoopClock = time) -> None:
        self.cfg = cfg
        self.clock = clock
        self.model = model
        self.fmt = cfg.delivery.format
        req_type = Request[model.input_type]  # type: ignore[name-defined]
        self.decoder: Any = (msgspec.json.Decoder(req_type) if self.fmt == "json"
                             else msgspec.msgpack.Decoder(req_type))
        self.max_bytes = cfg.delivery.max_input_bytes
        self.topic_lanes = cfg.lane_topics()
        self.lanes = {lane.name: lane for lane in cfg.batching.lanes}
        # Per lane, its deadline budget in seconds (None: no budget), and per topic the lane it routes to when
        # it names a known lane: both read once per record in admit().
        self._budget_s = {n: (ln.deadline_ms / 1000.0 if ln.deadline_ms is not None else None)
                          for n, ln in self.lanes.items()}
        self._topic_lane = {t: ln for t, ln in self.topic_lanes.items() if ln in self.lanes}
        self.default_lane = cfg.batching.default_lane
        # A handler with decode_batch is decoded on the device's host threads: its record carries the
        # validated inputs, sized by estimate_size before decoding.
        self._deferred = callable(getattr(model, "decode_batch", None))
        self._size_of = getattr(model, "estimate_size" if self._deferred else "size_of", None)
        self._max_size = getattr(model, "max_size", None)  # the most one record may cost the model
        self.cache_on = cfg.redis.cache
        self.model_id = (str(getattr(model, "name", cfg.model.name)),
                         str(cfg.model.version or getattr(model, "version", "")))
        self.unknown_lane_count = 0
        # Since the last report_unknown_lanes(): records per topic, and a few of the names asked for.
        self._unknown_by_topic: dict[str, int] = {}
        self._unknown_names: set[str] = set()
        # The scheduler owns the routing rule (header > field > topic > default lane).
        self._route = route or PriorityScheduler(cfg.batching.lanes, cfg.batching.default_lane).lane_for

    def lane_for(self, topic: str, header: str | None, field: str | None) -> str:
        """The routing rule (the scheduler's). ``admit`` answers the common case itself (no header, no
        ``priority`` field, a topic with a known lane) from ``_topic_lane`` before calling this."""
        lane, unknown = self._route(topic, header, field, self.topic_lanes)
        if unknown:  # not an error: the record is served by the default lane (counted, reported later)
            self.unknown_lane_count += 1
            self._unknown_by_topic[topic] = self._unknown_by_topic.get(topic, 0) + 1
            if len(self._unknown_names) < UNKNOWN_NAMES_LOGGED:
                name = next((w.strip() for w in (header, field) if w and w.strip()), topic)
                self._unknown_names.add(name[:64])  # client text in a log line: bounded
        return lane

    def report_unknown_lanes(self, metrics: Metrics) -> None:
        """Export (``kiw_unknown_lane_total{topic}``) and log the records that named no lane since the last
        call. Called at metrics report time, not per record: the warning comes at most once per report
        interval however many records a misconfigured producer sends."""
        if not self._unknown_by_topic:
            return
        counts, names = self._unknown_by_topic, sorted(self._unknown_names)
        self._unknown_by_topic, self._unknown_names = {}, set()
        for topic, n in counts.items():
            metrics.event("unknown_lane", n, topic=topic)
        log.warning("%d records named a lane that does not exist (e.g. %s); served by the default lane %r",
                    sum(counts.values()), ", ".join(repr(n) for n in names), self.default_lane,
                    extra={"per_topic": counts})

    def admit(self, rec: Record, now: float) -> Outcome | None:
        """Fills rec.id/item/lane/deadline/size/meta. Returns an Outcome when the record is rejected."""
        rejected: list[Outcome] = []
        self.admit_many([rec], now, rejected)
        return rejected[0] if rejected else None

    def admit_many(self, recs: list[Record], now: float, rejected: list[Outcome]) -> list[Record]:
        """``admit`` for each record of a poll batch, in order: returns the records admitted and appends the
        Outcome of each one rejected to ``rejected``. One loop over the batch, with what every record reads
        of the intake looked up once: a call and a dozen attribute lookups per record are a good part of
        admitting one in CPython."""
        admitted: list[Record] = []
        keep, reject = admitted.append, rejected.append
        topic_lanes, default_lane, budgets = self._topic_lane, self.default_lane, self._budget_s
        any_budget = any(b is not None for b in budgets.values())
        decode, max_bytes, fmt = self.decoder.decode, self.max_bytes, self.fmt
        deferred, model_decode = self._deferred, self.model.decode
        size_of, max_size, cache_on = self._size_of, self._max_size, self.cache_on
        for rec in recs:
            topic_lane = topic_lanes.get(rec.tp.topic)
            value = rec.value
            if value is None or len(value) > max_bytes:
                # The topic's lane, or the default one: a record rejected before routing is counted and
                # reported under a lane that exists (not the Record default "default").
                rec.lane = topic_lane or default_lane
                reject(self._unreadable(rec))
                continue
            try:
                req = decode(value)
            except msgspec.ValidationError as e:
                rec.lane = topic_lane or default_lane
                rec.id = salvage_id(value, fmt)
                reject(Outcome(rec, "error", error=f"invalid request: {e}", dlq_stage="validate"))
                continue
            except (msgspec.DecodeError, RecursionError) as e:
                # RecursionError: nesting deeper than the decoder's limit (a request like {"meta": [[...]]}).
                rec.lane = topic_lane or default_lane
                reject(Outcome(rec, "error", error=f"undecodable {fmt}: {e}", dlq_stage="decode"))
                continue
            rec.id = req.id
            if req.meta is not None:
                rec.meta = req.meta
            header = None
            if rec.headers:
                for k, v in rec.headers:
                    if k == H_PRIORITY and v:
                        header = v.decode("utf-8", "replace")
            if header is None and req.priority is None and topic_lane is not None:
                lane = topic_lane  # the common case: the topic decides
            else:
                lane = self.lane_for(rec.tp.topic, header, req.priority)
            rec.lane = lane
            if req.deadline_ms is not None:
                # Wall-clock deadline -> the monotonic clock the scheduler uses.
                rec.deadline = now + (req.deadline_ms / 1000.0 - self.clock.time())
            elif any_budget:
                budget = budgets[lane]
                if budget is not None:
                    rec.deadline = rec.received_at + budget
            deadline = rec.deadline
            if deadline is not None and deadline <= now:
                reject(Outcome(rec, "expired", error="deadline passed before the record was read",
                               dlq_stage="expired"))
                continue
            if cache_on:
                try:
                    rec.cache_key = cache_key(*self.model_id, _cache_input.encode(req.inputs))
                except UNENCODABLE:
                    pass  # inputs msgpack cannot write (an int beyond 64 bits): not cached, still processed
            try:
                rec.item = req.inputs if deferred else model_decode(req.inputs)
                if size_of is not None:
                    rec.size = int(size_of(rec.item))
                    if max_size is not None and rec.size > max_size:
                        reject(Outcome(rec, "error", dlq_stage="size",
                                       error=f"record size {rec.size} (the model's size_of) is over the "
                                             f"model's max_size={max_size}"))
                        continue
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as e:  # noqa: BLE001 - a handler bug on one input must not stop the partition
                # BaseException too: a Rust tokenizer's panic arrives as pyo3's PanicException, which is not
                # an Exception. This runs on the loop thread, before any attempt is counted: escaping, it
                # would stop the worker at every restart, and the record would never be quarantined.
                reject(Outcome(rec, "error", error=f"model decode failed: {type(e).__name__}: {e}",
                               dlq_stage="decode"))
                continue
            keep(rec)
        return admitted

    def _unreadable(self, rec: Record) -> Outcome:
        """The outcome of a record with no value or one over ``delivery.max_input_bytes``."""
        if rec.value is None:
            return Outcome(rec, "error", error="empty record value (tombstone)", dlq_stage="decode")
        return Outcome(rec, "error", dlq_stage="size",
                       error=f"record value is {len(rec.value)} bytes, over "
                             f"delivery.max_input_bytes={self.max_bytes}")
