"""What the runner asks of the optional store (Redis, or in memory): the delivered-id ledger, the result cache
and the attempt counters (docs/redis.md).

One round trip per feature per consumed batch on the way in (``admit``), one per batch dispatched to a
device (``count_dispatch``), and what delivery settled is written once per loop turn (``flush``). Every store
call fails softly: on a Redis outage the store answers "unknown" (not delivered, no count, no cache hit) and
the record is simply processed, so nothing is lost.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import msgspec

from worker.config.settings import Config, ModelConfig
from worker.core.ports import Metrics, Store
from worker.core.records import Batch, Outcome, Record
from worker.output.result_encoding import UNENCODABLE

_cache_enc = msgspec.msgpack.Encoder()
_cache_dec = msgspec.msgpack.Decoder()
# Sorted keys: equal options written in another order give the same fingerprint.
_fingerprint_enc = msgspec.json.Encoder(order="sorted")


def attempt_key(group_id: str, rec: Record) -> str:
    """Attempts are counted per consumer group and source position: the same record read again after a crash
    has the same key. The group is part of it because deployments may share one Redis (and key_prefix) and
    read the same input: a record that crashed one deployment's model says nothing about another's."""
    return f"{group_id}:{rec.tp.topic}:{rec.tp.partition}:{rec.offset}"


def ledger_key(output_topic: str, record_id: str) -> str:
    """The ledger says "this id has an ok result on this output topic": another deployment writing to another
    topic must still answer the id there, while a second group writing to the same topic may skip it."""
    return f"{output_topic}:{record_id}"


def model_fingerprint(model: ModelConfig) -> str:
    """A short hash of what decides the model's outputs besides its name and version: the configured name
    (a factory's module path, a file's full path), the options (weights path, factory arguments) and the
    dtype. Two models that report the same name and version (factory models are all version "0", minilm
    with ``options.path`` is versioned by the folder's name) then never share cached results."""
    # str_keys: YAML allows {0: neg, 1: pos}, which a sorted encoding refuses; enc_hook: a value JSON has no
    # type for hashes by its repr rather than failing the worker's start.
    plain = msgspec.to_builtins([model.name, model.options, model.dtype], str_keys=True, enc_hook=repr)
    canonical = _fingerprint_enc.encode(plain)
    return hashlib.sha256(canonical).hexdigest()[:16]


class StoreGate:
    def __init__(self, store: Store | None, cfg: Config, stats: Any, metrics: Metrics) -> None:
        self.store = store
        # The ledger and cache follow their flags (in memory without a Redis url). The ledger would skip a
        # record whose result an aborted transaction discarded, so exactly-once mode does without it. Attempt
        # counters only mean something across process restarts, so they need Redis.
        self.ledger = store is not None and cfg.redis.ledger and cfg.delivery.mode == "at_least_once"
        self.cache = store is not None and cfg.redis.cache
        self.attempts = store is not None and cfg.redis.url is not None
        self.max_attempts = cfg.delivery.max_attempts
        self.group_id = cfg.kafka.group_id
        self.output_topic = cfg.kafka.output_topic
        # Cache entries are stored under "<fingerprint>:<record's cache key>" (see model_fingerprint).
        self._cache_ns = model_fingerprint(cfg.model) + ":"
        self.stats = stats
        self.metrics = metrics
        # Written after delivery, once per loop turn (flush): one round trip for many records.
        self._delivered_ids: list[str] = []
        self._attempts_done: list[str] = []
        self._cache_puts: list[tuple[str, bytes]] = []

    # ------------------------------------------------------------------ on the way in
    def admit(self, admitted: list[Record], outcomes: list[Outcome], *, ack: Callable[[Record], None],
              isolate: Callable[[list[Record]], None]) -> list[Record]:
        """The records of a consumed batch that still need the model. The others: quarantined ones (attempt
        count at ``delivery.max_attempts``) and cache hits become ``outcomes``; records with a lower count
        (suspects) go to ``isolate``; records whose result was already delivered go to ``ack``."""
        if self.store is None:
            return admitted
        if self.attempts and admitted:
            admitted = self._sort_by_attempts(admitted, outcomes, isolate)
        if self.ledger and admitted:
            admitted = self._skip_delivered(admitted, ack)
        if self.cache and admitted:
            admitted = self._serve_cached(admitted, outcomes)
        return admitted

    def _sort_by_attempts(self, admitted: list[Record], outcomes: list[Outcome],
                          isolate: Callable[[list[Record]], None]) -> list[Record]:
        # Read only: a fetched record is not an attempt (thousands are fetched ahead of the device and would
        # all be counted at every crash). Attempts are counted at dispatch (count_dispatch).
        assert self.store is not None
        counts = self.store.get_attempts_many([attempt_key(self.group_id, r) for r in admitted])
        keep = []
        suspects = []
        for r, c in zip(admitted, counts, strict=True):
            r.attempts = c
            if c >= self.max_attempts:
                outcomes.append(Outcome(r, "error", dlq_stage="quarantine", error=(
                    f"quarantined: the worker process died {c} times while this record was on the device "
                    f"(delivery.max_attempts={self.max_attempts})")))
            elif c > 0:
                suspects.append(r)
            else:
                keep.append(r)
        if suspects:
            isolate(suspects)
            self.metrics.event("suspects_isolated", len(suspects))
        return keep

    def _skip_delivered(self, admitted: list[Record], ack: Callable[[Record], None]) -> list[Record]:
        assert self.store is not None
        out = self.output_topic
        seen = self.store.delivered_many([ledger_key(out, r.id) for r in admitted if r.id])
        if not seen:
            return admitted
        keep = []
        skipped = 0
        for r in admitted:
            if not r.id or ledger_key(out, r.id) not in seen:
                keep.append(r)
                continue
            # Its result was delivered before (redelivery after a crash or rebalance): done.
            ack(r)
            skipped += 1
        if skipped:
            self.stats.ledger_skips += skipped
            self.metrics.event("ledger_skips", skipped)  # once per batch: a redelivery skips thousands
        return keep

    def _serve_cached(self, admitted: list[Record], outcomes: list[Outcome]) -> list[Record]:
        assert self.store is not None
        ns = self._cache_ns
        hits = self.store.get_cached_many([ns + r.cache_key for r in admitted if r.cache_key])
        if not hits:
            return admitted
        keep = []
        for r in admitted:
            raw = hits.get(ns + r.cache_key) if r.cache_key else None
            try:
                out = _cache_dec.decode(raw) if raw is not None else None
            except Exception:  # a corrupt entry is a miss
                raw = None
            if raw is None:
                keep.append(r)
                continue
            outcomes.append(Outcome(r, "ok", output=out, batch_size=0, timings={"cached": 1.0}))
            self.stats.cache_hits += 1
        return keep

    # ------------------------------------------------------------------ device threads
    def count_dispatch(self, batch: Batch) -> None:
        """An attempt is a dispatch to the device: count it (one MULTI round trip per batch, bounded by
        redis.timeout_ms and the breaker) before the model can crash the process on it. A record put back
        by a preemption was counted when first taken and is not counted again."""
        if not self.attempts:
            return
        assert self.store is not None
        todo = [r for r in batch.records if not r.counted]
        if not todo:
            return
        counts = self.store.incr_attempts_many([attempt_key(self.group_id, r) for r in todo])
        for r, c in zip(todo, counts, strict=True):
            r.attempts = c
            r.counted = True

    def came_back(self, batch: Batch) -> None:
        """A suspect's batch came back from the device: it did not kill the process. Its counter is cleared
        before the next batch can be taken (bounded by redis.timeout_ms; on outage the count stays,
        harmless)."""
        if self.attempts:
            assert self.store is not None
            self.store.clear_attempts([attempt_key(self.group_id, r) for r in batch.records])

    # ------------------------------------------------------------------ after delivery (loop thread)
    def cache_put(self, rec: Record, output: Any) -> None:
        """Remember an ok output under the record's cache key (written at the next flush)."""
        if rec.cache_key is None or not self.cache:
            return
        try:
            self._cache_puts.append((self._cache_ns + rec.cache_key, _cache_enc.encode(output)))
        except UNENCODABLE:
            # not cacheable, e.g. an int beyond 64 bits for msgpack (the result itself is still produced)
            pass

    def delivered(self, rec: Record) -> None:
        """The record's result (or dead letter) is delivered: enter it in the ledger and clear its count. Only
        an ok result enters the ledger: a request that got an error or expired result may be sent again under
        the same id (a client's retry), and must then be processed, not acknowledged without a result."""
        if self.ledger and rec.id and not rec.failed:
            self._delivered_ids.append(ledger_key(self.output_topic, rec.id))
        if self.attempts and (rec.attempts > 0 or rec.counted) and rec.attempts < self.max_attempts:
            # Read with a count, or dispatched: counted, also where the INCR reply was lost (count unknown, 0)
            # after Redis applied it; DEL of a key that is not there costs nothing. A quarantined record keeps
            # its count until attempts_ttl_s: its dead letter is delivered before its offset is committed, and
            # a second poison record behind it killed the process in between; read again with no count, the
            # first one killed the next process, and the two took turns for good.
            self._attempts_done.append(attempt_key(self.group_id, rec))

    def delivered_many(self, recs: list[Record]) -> None:
        """``delivered`` for each record of a delivered batch (nothing to do without a ledger or counters)."""
        if self.ledger or self.attempts:
            for rec in recs:
                self.delivered(rec)

    def flush(self) -> None:
        st = self.store
        if st is None:
            return
        if self._delivered_ids:
            ids, self._delivered_ids = self._delivered_ids, []
            st.mark_delivered(ids)
        if self._attempts_done:
            keys, self._attempts_done = self._attempts_done, []
            st.clear_attempts(keys)
        if self._cache_puts:
            puts, self._cache_puts = self._cache_puts, []
            st.put_cached_many(puts)
