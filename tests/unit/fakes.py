"""Small fakes and builders for pure unit tests (no Kafka, no torch, no sleeping)."""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from worker.config.settings import LaneConfig
from worker.core.records import Record, TopicPartition


class FakeClock:
    """A monotonic clock the test moves by hand."""

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("a monotonic clock does not go backwards")
        self.t += seconds
        return self.t


_offsets = itertools.count()


def rec(lane: str = "default", *, topic: str = "in", partition: int = 0, offset: int | None = None,
        size: int = 1, deadline: float | None = None, received_at: float = 0.0,
        id: str | None = None) -> Record:
    """A record with just the fields the core looks at."""
    off = next(_offsets) if offset is None else offset
    return Record(tp=TopicPartition(topic, partition), offset=off, value=b"{}", lane=lane, size=size,
                  deadline=deadline, received_at=received_at,
                  id=id if id is not None else f"{topic}-{partition}-{off}")


def recs(n: int, lane: str = "default", **kw: object) -> list[Record]:
    return [rec(lane, **kw) for _ in range(n)]  # type: ignore[arg-type]


def lanes(*specs: dict[str, object]) -> list[LaneConfig]:
    """``lanes({"name": "hi", "priority": 1}, {"name": "lo"})``"""
    return [LaneConfig(**spec) for spec in specs]  # type: ignore[arg-type]


def ids(records: Iterable[Record]) -> list[str | None]:
    return [r.id for r in records]
