"""The store a config asks for: Redis when ``redis.url`` is set, else the in-memory one."""

from __future__ import annotations

from worker.adapters.memory_store import MemoryStore
from worker.adapters.store_keys import TimeSource
from worker.config import RedisConfig
from worker.core.ports import Metrics, Store


def make_store(cfg: RedisConfig, metrics: Metrics | None = None, *,
               clock: TimeSource | None = None) -> Store:
    """RedisStore when ``redis.url`` is set, else a per-process MemoryStore with the same TTLs."""
    if cfg.url:
        from worker.adapters.redis_store import RedisStore  # imports redis only when it is configured

        return RedisStore(cfg, metrics, clock=clock)
    return MemoryStore.from_config(cfg, clock=clock)
