"""Redis implementation of the ``Store`` port: result cache, delivered-id ledger, attempt counters.

Keys (``key_prefix`` defaults to ``kiw:``; the part after ``<kind>:`` is what the caller passes, here as
``worker.pipeline.store_gate`` builds it, so that deployments sharing one Redis keep apart)::

    <prefix>cache:<model fingerprint>:<sha256>       result bytes   SET EX cache_ttl_s   (redis.cache: true)
    <prefix>delivered:<output topic>:<id>            "1"            SET EX ledger_ttl_s  (redis.ledger: true)
    <prefix>attempts:<group>:<topic>:<partition>:<offset>
                                                     integer        INCR + EXPIRE attempts_ttl_s, in one MULTI

Batched forms for the hot path, one round trip each: ``get_cached_many`` (one MGET), ``put_cached_many``
(one pipeline of SET EX), ``delivered_many`` (one MGET), ``mark_delivered`` (one pipeline of SETs),
``get_attempts_many`` (one MGET, read only), ``incr_attempts_many`` (one MULTI of INCR+EXPIRE per key),
``clear_attempts`` (one pipeline of DELs).

Redis is an optimisation, never a dependency of the pipeline: every call has a short socket timeout
(``timeout_ms``), no client-side retries, and goes through a :class:`CircuitBreaker`. After
``breaker_failures`` consecutive errors the breaker opens and every call returns its "miss" value at once
(``None`` / ``False`` / empty set / ``{}`` / ``0`` = "unknown" for ``incr_attempts``, a list of 0s for
``incr_attempts_many``) without touching the
network; after ``breaker_reset_s`` one probe call goes through and closes it again on success. Each call
that could not use Redis (an error, or skipped by the open breaker) counts in ``kiw_redis_errors_total{op}``;
``kiw_redis_circuit_open`` is 1 while the breaker is not closed.

Nothing connects in ``__init__``; the client is built on first use. The password (in the URL or in
``redis.password``) never appears in reprs or log lines.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from worker.config.semantics import redis_url_problem
from worker.config.settings import RedisConfig
from worker.core.ports import Metrics, NullMetrics
from worker.store.keys import TimeSource, as_time_fn, cache_key

__all__ = ["CircuitBreaker", "RedisStore", "cache_key", "redact_url"]

log = logging.getLogger("worker.redis")
T = TypeVar("T")
_DEL_CHUNK = 1000  # keys per DEL command in clear_attempts' pipeline


def redact_url(url: str) -> str:
    """``redis://user:secret@host:6379/0`` -> ``redis://user:***@host:6379/0``."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable url>"
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port else ""
    return urlunsplit((parts.scheme, f"{user}:***@{host}{port}", parts.path, parts.query, parts.fragment))


class CircuitBreaker:
    """closed -> open after ``failures`` consecutive failures -> half-open after ``reset_s`` -> closed on
    the first success (or open again on failure). In half-open exactly one probe call is let through at a
    time. ``on_change(state)`` is called after each transition, outside the lock."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"

    def __init__(self, failures: int = 3, reset_s: float = 5.0, clock: TimeSource | None = None,
                 on_change: Callable[[str], None] | None = None) -> None:
        if failures < 1:
            raise ValueError(f"failures must be >= 1, got {failures}")
        if reset_s <= 0:
            raise ValueError(f"reset_s must be > 0, got {reset_s}")
        self.failures = failures
        self.reset_s = reset_s
        self._now = as_time_fn(clock)
        self._on_change = on_change
        self._lock = threading.Lock()
        self._state = self.CLOSED
        self._consecutive = 0
        self._opened_at = 0.0
        self._probe_started: float | None = None

    def __repr__(self) -> str:
        return f"CircuitBreaker({self.state}, failures={self._consecutive}/{self.failures})"

    @property
    def state(self) -> str:
        with self._lock:
            if self._state == self.OPEN and self._now() - self._opened_at >= self.reset_s:
                return self.HALF_OPEN
            return self._state

    def allow(self) -> bool:
        """May a call go to the backend now? In half-open only one probe at a time gets True."""
        changed = None
        with self._lock:
            now = self._now()
            if self._state == self.CLOSED:
                return True
            if self._state == self.OPEN:
                if now - self._opened_at < self.reset_s:
                    return False
                self._state = changed = self.HALF_OPEN
                self._probe_started = None
            # half-open: one probe; a probe that never reported back (lost thread) is replaced after reset_s
            if self._probe_started is not None and now - self._probe_started < self.reset_s:
                allowed = False
            else:
                self._probe_started = now
                allowed = True
        self._notify(changed)
        return allowed

    def record_success(self) -> None:
        changed = None
        with self._lock:
            if self._state == self.HALF_OPEN:
                self._state = changed = self.CLOSED
                self._probe_started = None
            if self._state == self.CLOSED:
                self._consecutive = 0
            # A late success from a call admitted before the breaker opened proves little: stay open.
        self._notify(changed)

    def record_failure(self) -> None:
        changed = None
        with self._lock:
            now = self._now()
            if self._state == self.HALF_OPEN:
                self._state = changed = self.OPEN
                self._opened_at = now
                self._probe_started = None
            elif self._state == self.CLOSED:
                self._consecutive += 1
                if self._consecutive >= self.failures:
                    self._state = changed = self.OPEN
                    self._opened_at = now
        self._notify(changed)

    def _notify(self, state: str | None) -> None:
        if state is not None and self._on_change is not None:
            self._on_change(state)


class RedisStore:
    """``Store`` on Redis with a circuit breaker; see the module docstring for keys and outage behaviour."""

    def __init__(self, cfg: RedisConfig, metrics: Metrics | None = None, *,
                 clock: TimeSource | None = None) -> None:
        if not cfg.url:
            raise ValueError("redis.url is required for RedisStore (leave it unset to use "
                             "the in-memory store)")
        scheme = urlsplit(cfg.url).scheme
        problem = redis_url_problem(cfg.url, tls=cfg.tls)  # the scheme too
        if problem:
            # Here, not from the first call on the loop thread: redis-py parses the URL only when it builds
            # the client, and its ValueError would escape the breaker (it is not a RedisError) and end the
            # worker.
            raise ValueError(f"redis.url: {problem}")
        if cfg.tls_ca_file and not (cfg.tls or scheme == "rediss"):  # config validation refuses it first
            raise ValueError("redis.tls_ca_file is set but TLS is off: set redis.tls: true or use rediss://")
        self._cfg = cfg
        self._metrics: Metrics = metrics or NullMetrics()
        self.cache_enabled = cfg.cache
        self.ledger_enabled = cfg.ledger
        self._prefix = cfg.key_prefix
        self._lock = threading.Lock()
        self._client_obj: redis.Redis | None = None
        self._last_error: str | None = None
        self.breaker = CircuitBreaker(cfg.breaker_failures, cfg.breaker_reset_s, clock,
                                      on_change=self._breaker_changed)

    def __repr__(self) -> str:
        return f"RedisStore({self.url}, breaker={self.breaker.state})"

    @property
    def url(self) -> str:
        """The configured URL with any password replaced by ``***``."""
        return redact_url(self._url())

    def _url(self) -> str:
        url = self._cfg.url or ""
        if self._cfg.tls and url.startswith("redis://"):
            url = "rediss://" + url[len("redis://"):]
        return url

    def _client_kwargs(self) -> dict[str, Any]:
        timeout = self._cfg.timeout_ms / 1000.0
        kw: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            # No client-side retries: the breaker decides when to try again, and a retry with backoff would
            # turn a short timeout into seconds of blocking on the loop thread.
            "retry": Retry(NoBackoff(), 0),
            "retry_on_timeout": False,
            "health_check_interval": 0,
        }
        if self._cfg.password:
            kw["password"] = self._cfg.password
        if self._url().startswith("rediss://") and self._cfg.tls_ca_file:
            kw["ssl_ca_certs"] = self._cfg.tls_ca_file
        return kw

    def _client(self) -> redis.Redis:
        client = self._client_obj
        if client is None:
            with self._lock:
                if self._client_obj is None:
                    self._client_obj = redis.Redis.from_url(self._url(), **self._client_kwargs())
                client = self._client_obj
        return client

    def _breaker_changed(self, state: str) -> None:
        self._metrics.gauge("redis_circuit_open", 0.0 if state == CircuitBreaker.CLOSED else 1.0)
        if state == CircuitBreaker.OPEN:
            log.warning("redis circuit open: store calls return misses for %.1fs",
                        self._cfg.breaker_reset_s,
                        extra={"redis_url": self.url, "error": self._last_error})
        elif state == CircuitBreaker.CLOSED:
            log.info("redis circuit closed: store is back", extra={"redis_url": self.url})

    def _redact(self, text: str) -> str:
        for secret in (self._cfg.password, urlsplit(self._cfg.url or "").password):
            if secret:
                text = text.replace(secret, "***")
        return text

    def _run(self, op: str, miss: T, fn: Callable[[redis.Redis], T]) -> T:
        if not self.breaker.allow():
            self._metrics.event("redis_errors", op=op)
            return miss
        try:
            result = fn(self._client())
        except (redis.RedisError, OSError) as e:
            self._last_error = self._redact(f"{type(e).__name__}: {e}")
            self._metrics.event("redis_errors", op=op)
            log.debug("redis %s failed", op, extra={"error": self._last_error})
            self.breaker.record_failure()
            return miss
        self.breaker.record_success()
        return result

    def _k(self, kind: str, key: str) -> str:
        return f"{self._prefix}{kind}:{key}"

    # -- result cache -------------------------------------------------------------------------------
    def get_cached(self, key: str) -> bytes | None:
        if not self.cache_enabled:
            return None
        return self._run("get_cached", None, lambda c: c.get(self._k("cache", key)))

    def get_cached_many(self, keys: Sequence[str]) -> dict[str, bytes]:
        """The cached results among ``keys``, in one MGET; absent keys are left out. ``{}`` on outage."""
        uniq = list(dict.fromkeys(keys))
        if not self.cache_enabled or not uniq:
            return {}

        def mget(c: redis.Redis) -> dict[str, bytes]:
            values = c.mget([self._k("cache", k) for k in uniq])
            return {k: v for k, v in zip(uniq, values, strict=True) if v is not None}

        return self._run("get_cached_many", {}, mget)

    def put_cached(self, key: str, value: bytes) -> None:
        if not self.cache_enabled:
            return
        self._run("put_cached", None, lambda c: c.set(self._k("cache", key), value, ex=self._cfg.cache_ttl_s))

    def put_cached_many(self, items: Sequence[tuple[str, bytes]]) -> None:
        """``put_cached`` for each (key, value), in one pipeline of SET EX (one round trip)."""
        if not self.cache_enabled or not items:
            return

        def pipelined(c: redis.Redis) -> None:
            pipe = c.pipeline(transaction=False)
            for key, value in items:
                pipe.set(self._k("cache", key), value, ex=self._cfg.cache_ttl_s)
            pipe.execute()

        self._run("put_cached_many", None, pipelined)

    # -- delivered-id ledger ------------------------------------------------------------------------
    def was_delivered(self, record_id: str) -> bool:
        if not self.ledger_enabled:
            return False
        return self._run("was_delivered", False,
                         lambda c: c.exists(self._k("delivered", record_id)) > 0)

    def delivered_many(self, record_ids: Iterable[str]) -> set[str]:
        """The subset of ``record_ids`` already delivered, in one MGET. Empty set when unknown."""
        ids = list(dict.fromkeys(record_ids))
        if not self.ledger_enabled or not ids:
            return set()

        def mget(c: redis.Redis) -> set[str]:
            values = c.mget([self._k("delivered", rid) for rid in ids])
            return {rid for rid, v in zip(ids, values, strict=True) if v is not None}

        return self._run("delivered_many", set(), mget)

    def mark_delivered(self, record_ids: Sequence[str]) -> None:
        if not self.ledger_enabled or not record_ids:
            return

        def pipelined(c: redis.Redis) -> None:
            pipe = c.pipeline(transaction=False)
            for rid in record_ids:
                pipe.set(self._k("delivered", rid), b"1", ex=self._cfg.ledger_ttl_s)
            pipe.execute()

        self._run("mark_delivered", None, pipelined)

    # -- attempt counters ---------------------------------------------------------------------------
    def incr_attempts(self, attempt_key: str) -> int:
        """Count one more attempt and return the total; 0 means "unknown" (Redis unavailable)."""
        key = self._k("attempts", attempt_key)

        def incr(c: redis.Redis) -> int:
            # MULTI/EXEC so a crash between the two never leaves a counter without expiry.
            pipe = c.pipeline(transaction=True)
            pipe.incr(key)
            pipe.expire(key, self._cfg.attempts_ttl_s)
            n, _ = pipe.execute()
            return int(n)

        return self._run("incr_attempts", 0, incr)

    def get_attempts_many(self, attempt_keys: Sequence[str]) -> list[int]:
        """The current count of each key, in order, in one MGET, without counting. 0 = none, or unknown
        (Redis unavailable)."""
        keys = list(attempt_keys)
        if not keys:
            return []

        def mget(c: redis.Redis) -> list[int]:
            return [int(v) if v is not None else 0 for v in c.mget([self._k("attempts", k) for k in keys])]

        return self._run("get_attempts_many", [0] * len(keys), mget)

    def incr_attempts_many(self, attempt_keys: Sequence[str]) -> list[int]:
        """``incr_attempts`` for each key, in order, in one MULTI pipeline (INCR + EXPIRE per key; a key
        listed twice counts twice). On outage: a list of 0s ("unknown"), one per key."""
        keys = list(attempt_keys)
        if not keys:
            return []

        def incr(c: redis.Redis) -> list[int]:
            pipe = c.pipeline(transaction=True)
            for k in keys:
                rk = self._k("attempts", k)
                pipe.incr(rk)
                pipe.expire(rk, self._cfg.attempts_ttl_s)
            replies = pipe.execute()
            return [int(n) for n in replies[0::2]]

        return self._run("incr_attempts_many", [0] * len(keys), incr)

    def clear_attempts(self, attempt_keys: Sequence[str]) -> None:
        """Deletes the counters in one round trip (one pipeline of DELs of at most 1,000 keys each)."""
        keys = [self._k("attempts", k) for k in dict.fromkeys(attempt_keys)]
        if not keys:
            return

        def delete(c: redis.Redis) -> None:
            pipe = c.pipeline(transaction=False)
            for i in range(0, len(keys), _DEL_CHUNK):
                pipe.delete(*keys[i:i + _DEL_CHUNK])
            pipe.execute()

        self._run("clear_attempts", None, delete)

    # -- housekeeping -------------------------------------------------------------------------------
    def ping(self) -> bool:
        return self._run("ping", False, lambda c: bool(c.ping()))

    def close(self) -> None:
        with self._lock:
            client, self._client_obj = self._client_obj, None
        if client is not None:
            with contextlib.suppress(redis.RedisError, OSError):
                client.close()
