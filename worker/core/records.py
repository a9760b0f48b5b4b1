"""The plain data that flows through the pipeline."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

import msgspec

Status = Literal["ok", "error", "expired"]


class TopicPartition(NamedTuple):
    topic: str
    partition: int


class Record(msgspec.Struct, eq=False, gc=False):
    """One consumed request, decoded, on its way through a lane.

    ``received_at`` and ``deadline`` are monotonic seconds (the runner's clock); ``deadline`` is None when
    neither the request nor its lane sets one.

    A msgspec Struct: its constructor runs in C, about half the cost of a dataclass's per consumed record.
    Records compare and hash by identity (``eq=False``). The cyclic garbage collector does not track them
    (``gc=False``, cheaper to make and to fill in): nothing a record holds refers back to it (its item and
    meta come from the request's bytes), so no reference cycle runs through a record, and reference
    counting frees it.
    """

    tp: TopicPartition
    offset: int
    value: bytes
    key: bytes | None = None
    headers: list[tuple[str, bytes]] = msgspec.field(default_factory=list)
    received_at: float = 0.0
    # Right after received_at so the consume loop passes all it knows positionally (keywords cost ~0.3 us).
    produced_at_ms: int | None = None  # Kafka record timestamp (CreateTime), for end-to-end latency
    epoch: int = 0  # the partition's assignment epoch at receive; acks from an older epoch are ignored
    id: str | None = None
    item: Any = None  # what the model handler's decode() returned
    lane: str = "default"
    deadline: float | None = None
    size: int = 1  # a size hint (e.g. token count) for bucketing; 1 when the model gives none
    meta: Any = None  # the request's opaque ``meta`` echoed back in the result
    attempts: int = 0
    counted: bool = False  # this process counted a dispatch attempt for it (crash-loop protection)
    cache_key: str | None = None  # result-cache key (model, version, inputs), when the cache is on
    # Its result is an error or expired one: the delivered-id ledger leaves its id out, so that its sender
    # may send the request again under the same id.
    failed: bool = False


@dataclass(slots=True, eq=False)
class Batch:
    lane: str
    records: list[Record]
    opened_at: float  # monotonic time of the window's first record
    closed_at: float
    reason: str  # "count" | "time" | "idle" | "flush" | "adaptive"
    max_batch_size: int = 0
    # Records of lower-priority lanes were added to its free slots (lane option fill_with_lower): each
    # record's own lane is record.lane, not necessarily this batch's.
    mixed: bool = False
    # Taken while its device was busy (``next_batch(idle=False)``) and not started yet: its lane still has
    # work waiting (see PriorityScheduler.start).
    ahead: bool = False

    def __len__(self) -> int:
        return len(self.records)

    def with_records(self, records: list[Record]) -> Batch:
        """The same batch holding ``records`` instead (some of its records left it before it started)."""
        return Batch(self.lane, records, self.opened_at, self.closed_at, self.reason, self.max_batch_size,
                     self.mixed)

    @property
    def fill_ratio(self) -> float:
        return len(self.records) / self.max_batch_size if self.max_batch_size else 1.0


@dataclass(slots=True)
class Outcome:
    """What happened to one record. ``dlq_stage`` set means it also goes to the dead-letter topic."""

    record: Record
    status: Status
    output: Any = None
    error: str | None = None
    # "decode" | "validate" | "size" | "inference" | "expired" | "quarantine" ...
    dlq_stage: str | None = None
    batch_size: int = 0
    timings: dict[str, float] = field(default_factory=dict)
