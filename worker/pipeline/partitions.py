"""Every per-partition fact the loop keeps, in one object per partition (``Partition``).

An epoch numbers each ownership of a partition: it rises on assign, on release and on a rewind, and a
record carries the epoch it was read under. A record whose epoch is no longer its partition's belongs to
the new owner or to the rewound reader: it is neither run, emitted nor acknowledged here (``is_current``).

A partition's entry outlives its assignment: its epoch must keep rising, and what this worker committed of
it (``committed``) and whether a backfill read it to its end (``reached``) are read after it was released.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from worker.core.records import Record, TopicPartition


@dataclass(slots=True, eq=False)
class Partition:
    tp: TopicPartition
    epoch: int = 0
    assigned: bool = False
    paused: bool = False  # what the loop asked the consumer for (backpressure, a backfill's end, shutdown)
    position: int | None = None  # next offset to read (backfill progress, lag without a commit)
    # Exactly-once: the first offset read since the assign or the last rewind, where a rewind seeks a
    # partition without a commit (auto.offset.reset or a backfill's start put the consumer there).
    first_read: int | None = None
    # Exactly-once: a rewind served inside consume() sought it back (to ``rewind_to``; None: no seek).
    rewound: bool = False
    rewind_to: int | None = None
    committed: int | None = None  # the last offset this worker committed
    live_high: int | None = None  # the high watermark a lag report last asked the broker for
    reached: bool = False  # backfill: read up to its end snapshot
    span_held: bool = False  # paused for its uncommitted span (the backpressure hysteresis)


class PartitionTable:
    """Owned by the loop thread; device threads only read epochs (``is_current``), a race that is benign:
    a record read as current just before its release is dropped by the loop when its outcome comes back."""

    def __init__(self, reached: Iterable[TopicPartition] = ()) -> None:
        self._all: dict[TopicPartition, Partition] = {}
        self._live: dict[TopicPartition, Partition] = {}  # the assigned ones
        self._any_rewound = False
        for tp in reached:
            self._entry(tp).reached = True

    def _entry(self, tp: TopicPartition) -> Partition:
        p = self._all.get(tp)
        if p is None:
            p = self._all[tp] = Partition(TopicPartition(tp.topic, tp.partition))
        return p

    # ---- ownership
    def assign(self, tps: Iterable[TopicPartition]) -> None:
        for tp in tps:
            p = self._entry(tp)
            p.epoch += 1
            p.assigned = True
            p.first_read = None
            self._live[p.tp] = p

    def release(self, tps: Iterable[TopicPartition]) -> None:
        """Forgets what this ownership read; keeps the epoch (now past every record read) and the commit.
        A backfill partition assigned again is read again from its commit, which may be short of its end:
        reaching the end again says so."""
        for tp in tps:
            p = self._entry(tp)
            p.epoch += 1
            p.assigned = p.paused = p.rewound = p.reached = p.span_held = False
            p.position = p.first_read = p.rewind_to = p.live_high = None
            self._live.pop(tp, None)

    def rewind(self, tps: Iterable[TopicPartition]) -> dict[TopicPartition, int]:
        """A new epoch for ``tps`` (everything in flight is forgotten); returns and forgets the first offset
        read of each since its assign or last rewind."""
        first: dict[TopicPartition, int] = {}
        for tp in tps:
            p = self._entry(tp)
            p.epoch += 1
            if p.first_read is not None:
                first[tp] = p.first_read
            p.first_read = None
        return first

    def is_current(self, rec: Record) -> bool:
        p = self._all.get(rec.tp)
        return (p.epoch if p is not None else 0) == rec.epoch

    def epoch(self, tp: TopicPartition) -> int:
        p = self._all.get(tp)
        return p.epoch if p is not None else 0

    # ---- lookups
    def live(self, tp: tuple[str, int]) -> Partition | None:
        """The assigned partition ``tp`` (a plain (topic, partition) tuple will do), or None."""
        return self._live.get(tp)  # type: ignore[call-overload]

    def is_assigned(self, tp: TopicPartition) -> bool:
        return tp in self._live

    @property
    def assigned(self) -> frozenset[TopicPartition]:
        return frozenset(self._live)

    def live_partitions(self) -> list[Partition]:
        return list(self._live.values())

    def __len__(self) -> int:
        return len(self._live)

    # ---- pauses
    @property
    def paused(self) -> set[TopicPartition]:
        return {tp for tp, p in self._live.items() if p.paused}

    def set_paused(self, tps: Iterable[TopicPartition], paused: bool = True) -> None:
        for tp in tps:
            p = self._live.get(tp)
            if p is not None:
                p.paused = paused

    @property
    def span_held(self) -> set[TopicPartition]:
        return {tp for tp, p in self._live.items() if p.span_held}

    def set_span_held(self, tps: set[TopicPartition]) -> None:
        for tp, p in self._live.items():
            p.span_held = tp in tps

    # ---- backfill
    @property
    def reached(self) -> set[TopicPartition]:
        return {tp for tp, p in self._all.items() if p.reached}

    def mark_reached(self, tp: TopicPartition) -> None:
        self._entry(tp).reached = True

    def unmark_reached(self, tp: TopicPartition) -> None:
        p = self._all.get(tp)
        if p is not None:
            p.reached = False

    # ---- commits
    @property
    def committed(self) -> dict[TopicPartition, int]:
        return {tp: p.committed for tp, p in self._all.items() if p.committed is not None}

    def last_commit(self, tp: TopicPartition) -> int | None:
        p = self._all.get(tp)
        return p.committed if p is not None else None

    def set_committed(self, offsets: dict[TopicPartition, int]) -> None:
        for tp, off in offsets.items():
            self._entry(tp).committed = off

    # ---- rewinds inside consume()
    def clear_rewound(self) -> None:
        if self._any_rewound:
            self.take_rewound()

    def note_rewound(self, tp: TopicPartition, to: int | None) -> None:
        p = self._entry(tp)
        p.rewound, p.rewind_to = True, to
        self._any_rewound = True

    def take_rewound(self) -> dict[TopicPartition, int | None]:
        """The partitions sought back since ``clear_rewound``, with their targets; forgets them."""
        if not self._any_rewound:
            return {}
        self._any_rewound = False
        out = {tp: p.rewind_to for tp, p in self._all.items() if p.rewound}
        for tp in out:
            self._all[tp].rewound = False
        return out
