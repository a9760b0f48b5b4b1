"""The state the loop's rooms share: one ``Loop`` per runner, built before the clients, filled in by
``Runner.run`` (consumer, emitter, intake) as they are made. ``clock`` is the one the runner was given.

Only the loop thread reads or writes it, except ``dispatch`` (device threads, under its lock) and
``lifecycle.request_stop`` (signals).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from worker.config.settings import Config
from worker.core.offsets import OffsetTracker
from worker.core.ports import Metrics
from worker.core.records import TopicPartition
from worker.pipeline.dispatch import Dispatch
from worker.pipeline.lifecycle import Lifecycle
from worker.pipeline.partitions import PartitionTable
from worker.pipeline.store_gate import StoreGate
from worker.timing.clock import LoopClock


@dataclass
class RunStats:
    records_in: int = 0
    results_ok: int = 0
    results_error: int = 0
    results_expired: int = 0
    dlq: int = 0
    batches: int = 0
    batched_records: int = 0
    commits: int = 0
    started: float = 0.0  # on the loop's clock
    ledger_skips: int = 0
    cache_hits: int = 0

    @property
    def mean_batch(self) -> float:
        return self.batched_records / self.batches if self.batches else 0.0


@dataclass(eq=False)
class Loop:
    cfg: Config
    metrics: Metrics
    stats: RunStats
    lifecycle: Lifecycle
    partitions: PartitionTable
    tracker: OffsetTracker
    gate: StoreGate
    dispatch: Dispatch
    health: Any = None
    stop_at: dict[TopicPartition, int] | None = None  # backfill: the end offsets to stop at
    consumer: Any = None  # replaced when it stays out of its group (Membership)
    emitter: Any = None  # worker.output.emit.Emitter, made once the producers are
    intake: Any = None  # worker.pipeline.intake.Intake, made once the model is loaded
    broker_ok: bool = True  # the last client call that needed a broker got an answer
    clock: LoopClock = time  # every time the rooms read comes from it

    def backfill_complete(self) -> bool:
        """Backfill: every partition read up to ``stop_at``, and nothing left in flight."""
        return (self.stop_at is not None and self.partitions.reached.issuperset(self.stop_at)
                and self.tracker.in_flight() == 0)

    def broker_reachable(self, ok: bool) -> None:
        self.broker_ok = ok
        if self.health is not None:
            self.health.broker_reachable = ok
