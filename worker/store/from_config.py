"""The store a config asks for: Redis when ``redis.url`` is set, else the in-memory one."""

from __future__ import annotations

from worker.config.settings import RedisConfig
from worker.core.ports import Metrics, Store
from worker.store.keys import TimeSource
from worker.store.memory_store import MemoryStore


def make_store(cfg: RedisConfig, metrics: Metrics | None = None, *,
               clock: TimeSource | None = None) -> Store:
    """RedisStore when ``redis.url`` is set, else a per-process MemoryStore with the same TTLs."""
    if cfg.url:
        from worker.store.redis_store import RedisStore  # imports redis only when it is configured

        return RedisStore(cfg, metrics, clock=clock)
    return MemoryStore.from_config(cfg, clock=clock)
