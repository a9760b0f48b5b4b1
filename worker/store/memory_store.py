"""In-process implementation of the ``Store`` port (the default when ``redis.url`` is not set).

Same semantics as :class:`worker.store.redis_store.RedisStore` — result cache, delivered-id ledger and
attempt counters, each with a TTL — but per process: nothing survives a restart and replicas do not share
it. Memory is bounded: the cache evicts least-recently-used entries, the ledger and the attempt counters
drop their oldest entries first (with one TTL per kind, oldest written is also first to expire).

Thread-safe (one lock): the loop thread and the inference threads may share one instance.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import Generic, TypeVar

from worker.config.settings import RedisConfig
from worker.store.keys import TimeSource, as_time_fn, cache_key

__all__ = ["MemoryStore", "TimeSource", "as_time_fn", "cache_key"]

V = TypeVar("V")


class _TTLMap(Generic[V]):
    """key -> (expires_at, value), bounded; ``lru`` moves entries to the end on read."""

    def __init__(self, max_entries: int, lru: bool) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        self.max_entries = max_entries
        self.lru = lru
        self._d: OrderedDict[str, tuple[float, V]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._d)

    def get(self, key: str, now: float) -> V | None:
        item = self._d.get(key)
        if item is None:
            return None
        expires, value = item
        if expires <= now:
            del self._d[key]
            return None
        if self.lru:
            self._d.move_to_end(key)
        return value

    def put(self, key: str, value: V, expires: float) -> None:
        self._d[key] = (expires, value)
        self._d.move_to_end(key)
        while len(self._d) > self.max_entries:
            self._d.popitem(last=False)

    def pop(self, key: str) -> None:
        self._d.pop(key, None)

    def purge_expired(self, now: float) -> int:
        dead = [k for k, (exp, _) in self._d.items() if exp <= now]
        for k in dead:
            del self._d[k]
        return len(dead)


class MemoryStore:
    """Bounded in-memory ``Store`` with TTLs. ``clock`` is a ``Clock`` or a callable returning seconds."""

    def __init__(self, *, cache_ttl_s: float = 3600.0, ledger_ttl_s: float = 86_400.0,
                 attempts_ttl_s: float = 86_400.0, max_cache_entries: int = 10_000,
                 max_ledger_entries: int = 1_000_000, max_attempt_entries: int = 100_000,
                 cache: bool = True, ledger: bool = True, clock: TimeSource | None = None) -> None:
        for name, ttl in (("cache_ttl_s", cache_ttl_s), ("ledger_ttl_s", ledger_ttl_s),
                          ("attempts_ttl_s", attempts_ttl_s)):
            if ttl <= 0:
                raise ValueError(f"{name} must be > 0, got {ttl}")
        self.cache_ttl_s = cache_ttl_s
        self.ledger_ttl_s = ledger_ttl_s
        self.attempts_ttl_s = attempts_ttl_s
        self.cache_enabled = cache
        self.ledger_enabled = ledger
        self._now = as_time_fn(clock)
        self._lock = threading.Lock()
        self._cache: _TTLMap[bytes] = _TTLMap(max_cache_entries, lru=True)
        self._ledger: _TTLMap[bool] = _TTLMap(max_ledger_entries, lru=False)
        self._attempts: _TTLMap[int] = _TTLMap(max_attempt_entries, lru=False)

    @classmethod
    def from_config(cls, cfg: RedisConfig, clock: TimeSource | None = None) -> MemoryStore:
        """Build from a ``RedisConfig`` (only the TTLs and the cache/ledger switches apply)."""
        return cls(cache_ttl_s=cfg.cache_ttl_s, ledger_ttl_s=cfg.ledger_ttl_s,
                   attempts_ttl_s=cfg.attempts_ttl_s,
                   cache=cfg.cache, ledger=cfg.ledger, clock=clock)

    def __repr__(self) -> str:
        return (f"MemoryStore(cache={len(self._cache)}/{self._cache.max_entries}, "
                f"ledger={len(self._ledger)}, attempts={len(self._attempts)})")

    # -- result cache -------------------------------------------------------------------------------
    def get_cached(self, key: str) -> bytes | None:
        if not self.cache_enabled:
            return None
        with self._lock:
            return self._cache.get(key, self._now())

    def get_cached_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        """The cached results among ``keys`` (missing or expired keys are absent), in one lock round."""
        if not self.cache_enabled or not keys:
            return {}
        with self._lock:
            now = self._now()
            out: dict[str, bytes] = {}
            for k in keys:
                v = self._cache.get(k, now)
                if v is not None:
                    out[k] = v
            return out

    def put_cached(self, key: str, value: bytes) -> None:
        if not self.cache_enabled:
            return
        with self._lock:
            self._cache.put(key, bytes(value), self._now() + self.cache_ttl_s)

    def put_cached_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """``put_cached`` for each (key, value), in one lock round."""
        if not self.cache_enabled or not items:
            return
        with self._lock:
            expires = self._now() + self.cache_ttl_s
            for key, value in items:
                self._cache.put(key, bytes(value), expires)

    # -- delivered-id ledger ------------------------------------------------------------------------
    def was_delivered(self, record_id: str) -> bool:
        if not self.ledger_enabled:
            return False
        with self._lock:
            return self._ledger.get(record_id, self._now()) is not None

    def delivered_many(self, record_ids: Iterable[str]) -> set[str]:
        """The subset of ``record_ids`` already delivered (one lock round for the hot path)."""
        if not self.ledger_enabled:
            return set()
        with self._lock:
            now = self._now()
            return {rid for rid in record_ids if self._ledger.get(rid, now) is not None}

    def mark_delivered(self, record_ids: Sequence[str]) -> None:
        if not self.ledger_enabled or not record_ids:
            return
        with self._lock:
            expires = self._now() + self.ledger_ttl_s
            for rid in record_ids:
                self._ledger.put(rid, True, expires)

    # -- attempt counters ---------------------------------------------------------------------------
    def incr_attempts(self, attempt_key: str) -> int:
        with self._lock:
            now = self._now()
            n = (self._attempts.get(attempt_key, now) or 0) + 1
            # Like INCR + EXPIRE: each attempt pushes the expiry out again.
            self._attempts.put(attempt_key, n, now + self.attempts_ttl_s)
            return n

    def get_attempts_many(self, attempt_keys: Sequence[str]) -> list[int]:
        """The current count of each key, in order, without counting (0 when there is none)."""
        if not attempt_keys:
            return []
        with self._lock:
            now = self._now()
            return [self._attempts.get(k, now) or 0 for k in attempt_keys]

    def incr_attempts_many(self, attempt_keys: Sequence[str]) -> list[int]:
        """``incr_attempts`` for each key, in order (a key listed twice counts twice), in one lock round."""
        if not attempt_keys:
            return []
        with self._lock:
            now = self._now()
            out: list[int] = []
            for k in attempt_keys:
                n = (self._attempts.get(k, now) or 0) + 1
                self._attempts.put(k, n, now + self.attempts_ttl_s)
                out.append(n)
            return out

    def clear_attempts(self, attempt_keys: Sequence[str]) -> None:
        if not attempt_keys:
            return
        with self._lock:
            for k in attempt_keys:
                self._attempts.pop(k)

    # -- housekeeping -------------------------------------------------------------------------------
    def purge_expired(self) -> int:
        """Drop expired entries now (reads also drop them lazily). Returns how many were dropped."""
        with self._lock:
            now = self._now()
            return sum(m.purge_expired(now) for m in (self._cache, self._ledger, self._attempts))

    def sizes(self) -> dict[str, int]:
        with self._lock:
            return {"cache": len(self._cache), "ledger": len(self._ledger), "attempts": len(self._attempts)}

    def close(self) -> None:
        pass
