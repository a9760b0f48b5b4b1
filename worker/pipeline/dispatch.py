"""Between the scheduler and the devices: which batch a device runs next (``take``, ``swap``) and how its
outputs come back (``done``, then ``completions``, which the loop drains).

Device threads call ``take``, ``swap`` and ``done``; the loop thread calls the rest. Everything the
scheduler and the suspects hold is read and changed under ``cv``.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from typing import Any

from worker.core.ports import Metrics
from worker.core.records import Batch, Record, TopicPartition
from worker.core.scheduler import PriorityScheduler
from worker.pipeline.lifecycle import Deadline, Lifecycle
from worker.pipeline.partitions import PartitionTable
from worker.pipeline.store_gate import StoreGate
from worker.timing.clock import LoopClock

log = logging.getLogger("worker.runner")
Completion = tuple[Batch, list[Any], dict[str, float]]
# A generation worker's records in flight: given the released partitions, it abandons theirs and returns them.
Holder = Callable[[set[TopicPartition]], list[Record]]


class Dispatch:
    def __init__(self, scheduler: PriorityScheduler, partitions: PartitionTable, lifecycle: Lifecycle,
                 gate: StoreGate, metrics: Metrics, clock: LoopClock = time) -> None:
        self.clock = clock
        self.scheduler = scheduler
        self._partitions = partitions
        self._lifecycle = lifecycle
        self._gate = gate
        self.metrics = metrics
        self.cv = threading.Condition()
        self.completions: queue.SimpleQueue[Completion] = queue.SimpleQueue()
        # Per device (by its index in the runner's workers): the batches it took and has not handed back. A
        # device is free when its own count is 0; all are when the sum is (a suspect runs only then).
        self.busy_on: list[int] = []
        # Records that were on a device when an earlier process died (attempt count > 0): each one goes to the
        # device alone, so the innocent ones clear themselves and only the killer keeps counting.
        self._suspects: deque[Record] = deque()
        self.isolated = 0  # suspects on a device now: nothing else is dispatched meanwhile
        self._holders: list[Holder] = []

    def devices(self, n: int) -> None:
        self.busy_on = [0] * n

    def on_limit(self, lane: str, new_max: int) -> None:
        """The engine lowers a lane's batch limit after an out-of-memory error and raises it back later."""
        with self.cv:
            lowered = new_max < self.scheduler.max_batch_size(lane)
            self.scheduler.set_max_batch_size(lane, new_max)
        if lowered:
            self.metrics.event("oom_splits", lane=lane)
        log.info("batch limit of lane %s now %d", lane, new_max,
                 extra={"lane": lane, "max_batch_size": new_max})

    def on_tokens(self, lane: str, tokens: int | None) -> None:
        """The engine lowers a lane's token budget after an out-of-memory error and puts it back later."""
        with self.cv:
            self.scheduler.set_max_batch_tokens(lane, tokens)
        log.info("token budget of lane %s now %s", lane, tokens,
                 extra={"lane": lane, "max_batch_tokens": tokens})

    def take(self, timeout: float, worker: int) -> Batch | None:
        batch = self.next_batch(timeout, worker)
        if batch is not None:
            self._gate.count_dispatch(batch)
        return batch

    def swap(self, batch: Batch) -> Batch | None:
        """The device is about to start ``batch`` (prefetched while it was busy): a higher-priority batch that
        became ready since goes first, and ``batch`` goes back to its lane (see PriorityScheduler.preempt).
        Its records past their deadline by now are expired first, and a partial batch taken ahead that keeps
        its place takes along what arrived since (see PriorityScheduler.top_up). Returns the batch to run
        instead, if any."""
        if batch.reason == "isolate":
            return None
        with self.cv:
            now = self.clock.monotonic()
            was_ahead = self.scheduler.start(batch)
            current = batch
            current_rec = self._partitions.is_current
            if not all(current_rec(r) for r in batch.records):
                # Their partition was released since the batch was taken (revoke, loss, rewind): those records
                # belong to the new owner or the rewound reader now; not to expire, requeue or run here.
                current = batch.with_records([r for r in batch.records if current_rec(r)])
            # Taken up to a batch-time ago: records whose deadline passed meanwhile are expired, not run.
            trimmed = self.scheduler.drop_expired(current, now)
            if trimmed is not None:  # (possibly empty: every record expired)
                current = trimmed
            changed = current if current is not batch else None
            if self._suspects or self.isolated or not current.records:
                return changed
            better = self.scheduler.preempt(current, now)
            if better is not None:
                self.metrics.event("preemptions_total", lane=batch.lane)
            elif was_ahead:
                # Not preempted: a partial batch taken ahead takes along what its lane (and, with
                # fill_with_lower, the lower lanes) received since it was taken.
                better = self.scheduler.top_up(current, now)
            if better is None:
                return changed
            better.closed_at = now
        self._gate.count_dispatch(better)  # only its records not counted yet
        return better

    def next_batch(self, timeout: float, worker: int) -> Batch | None:
        """``worker``: the index in ``workers`` of the device asking."""
        deadline = Deadline(timeout, self.clock)
        with self.cv:
            while True:
                now = self.clock.monotonic()
                while self._suspects and not self._partitions.is_current(self._suspects[0]):
                    self._suspects.popleft()  # revoked meanwhile
                batch = None
                if self._suspects:
                    # A suspect runs alone on an otherwise idle device (all devices), and the next batch is
                    # only taken after _done cleared its counter: so a count reaches 2 only for a record that
                    # was alone on the device when the process died.
                    if not any(self.busy_on):
                        rec = self._suspects.popleft()
                        self.busy_on[worker] += 1
                        self.isolated += 1
                        return Batch(lane=rec.lane, records=[rec], opened_at=now, closed_at=now,
                                     reason="isolate", max_batch_size=1)
                elif self.isolated == 0:  # not beside the last suspect either (other devices, pipelining)
                    # The collate stage asks for batch n+1 while batch n is on the device: then the device is
                    # busy and open windows must be left to fill (only closed ones go). A free device takes
                    # an open window at once (work-conserving).
                    idle = self.busy_on[worker] == 0
                    batch = self.scheduler.next_batch(now, idle=idle, full_only=not idle)
                if batch is not None:
                    self.busy_on[worker] += 1
                    batch.closed_at = now  # dispatch time: queue wait is measured up to here
                    return batch
                if now >= deadline.at or self._lifecycle.closed:
                    return None
                # While a suspect waits or runs, no batch is taken, so no window is closed and the scheduler's
                # wake-up stays overdue: waiting for it would spin. done()'s notify is the wake-up.
                wake = None if self._suspects or self.isolated else self.scheduler.next_wakeup(now)
                until = deadline.at if wake is None else min(deadline.at, wake)
                self.cv.wait(max(until - now, 0.0002))

    def done(self, batch: Batch, outputs: list[Any], timings: dict[str, float], worker: int) -> None:
        if batch.reason == "isolate":
            self._gate.came_back(batch)
        with self.cv:
            self.busy_on[worker] -= 1
            if batch.reason == "isolate":
                self.isolated -= 1
            if not timings.get("recovered"):
                # A batch bisected or split after an error took many forwards: as one observation it would
                # inflate the latency model the adaptive policy plans (and expires records) with.
                self.scheduler.observe(batch.lane, len(batch.records), timings.get("infer", 0.0))
            self.cv.notify_all()  # a device became free: a waiting collate stage may take an open window
        self.completions.put((batch, outputs, timings))

    # ---- generation workers (worker.pipeline.generation): records join a running batch one by one
    def hold(self, holder: Holder) -> None:
        """A generation worker keeps records in flight across steps: a revoke or rewind asks it for theirs."""
        self._holders.append(holder)

    def take_sequences(self, timeout: float, worker: int, in_flight: int,
                       only: frozenset[str] | None = None) -> Batch | None:
        """The next batch for a generation worker, whose sequences join its running batch at once (so an open
        window goes now: the worker is never "busy" the way a batch device is). ``in_flight``: its sequences
        not finished; a suspect goes only to a worker with none, and nothing else goes while it runs. Only a
        suspect's batch counts in ``busy_on`` (until ``done_sequences``). ``only``: take a batch only while
        one of these lanes has records queued (the worker's pool is full; these lanes' records go first)."""
        deadline = Deadline(timeout, self.clock)
        with self.cv:
            while True:
                now = self.clock.monotonic()
                while self._suspects and not self._partitions.is_current(self._suspects[0]):
                    self._suspects.popleft()
                batch = None
                if self._suspects:
                    if in_flight == 0 and not any(self.busy_on):
                        rec = self._suspects.popleft()
                        self.busy_on[worker] += 1
                        self.isolated += 1
                        batch = Batch(lane=rec.lane, records=[rec], opened_at=now, closed_at=now,
                                      reason="isolate", max_batch_size=1)
                elif self.isolated == 0 and (only is None or any(self.scheduler.queued(ln) for ln in only)):
                    batch = self.scheduler.next_batch(now, idle=True)
                if batch is not None:
                    batch.closed_at = now
                    break
                if now >= deadline.at or self._lifecycle.closed:
                    return None
                wake = None if self._suspects or self.isolated else self.scheduler.next_wakeup(now)
                until = deadline.at if wake is None else min(deadline.at, wake)
                self.cv.wait(max(until - now, 0.0002))
        self._gate.count_dispatch(batch)
        return batch

    def done_sequences(self, batch: Batch, outputs: list[Any], timings: dict[str, float],
                       worker: int) -> None:
        """Finished sequences, as a batch of their records (``reason="isolate"``: the suspect's)."""
        if batch.reason == "isolate":
            self._gate.came_back(batch)
            with self.cv:
                self.busy_on[worker] -= 1
                self.isolated -= 1
                self.cv.notify_all()
        self.completions.put((batch, outputs, timings))

    def is_current(self, rec: Record) -> bool:
        return self._partitions.is_current(rec)

    def _from_holders(self, tps: set[TopicPartition]) -> list[Record]:
        # Outside ``cv``: a holder takes its own lock, which it holds while it calls take_sequences.
        return [r for holder in self._holders for r in holder(tps)]

    # ---- loop side
    def add(self, records: Iterable[Record], now: float) -> list[Record]:
        """Queues ``records``; returns those the scheduler expired to make room (their deadline passed)."""
        late: list[Record] = []
        with self.cv:
            for rec in records:
                late.extend(self.scheduler.add(rec, now))
            self.cv.notify_all()
        return late

    def isolate(self, suspects: list[Record]) -> None:
        """Records that were on a device when an earlier process died: each goes to the device alone."""
        with self.cv:
            self._suspects.extend(suspects)
            self.cv.notify_all()

    def expire(self, now: float) -> list[Record]:
        """Takes the queued records (suspects too) whose deadline has passed."""
        with self.cv:
            expired = list(self.scheduler.expire(now))
            if self._suspects and any(r.deadline is not None and r.deadline <= now for r in self._suspects):
                expired += [r for r in self._suspects if r.deadline is not None and r.deadline <= now]
                self._suspects = deque(r for r in self._suspects if r.deadline is None or r.deadline > now)
        return expired

    def revoke(self, tps: set[TopicPartition]) -> list[Record]:
        """Drops the queued records of ``tps`` (suspects too); returns them."""
        with self.cv:
            dropped = list(self.scheduler.revoke(tps))
            dropped += [r for r in self._suspects if r.tp in tps]
            self._suspects = deque(r for r in self._suspects if r.tp not in tps)
        return dropped + self._from_holders(tps)

    def clear(self, tps: set[TopicPartition]) -> None:
        """A rewind: every queued record of ``tps`` and every suspect is forgotten."""
        with self.cv:
            self.scheduler.revoke(tps)
            self._suspects.clear()
        self._from_holders(tps)

    def flush(self, now: float) -> None:
        """Stopping: every open window closes, so the devices take what is queued at once."""
        with self.cv:
            self.scheduler.flush(now)
            self.cv.notify_all()

    def over_bound(self, full: set[str], ratio: float) -> set[str]:
        with self.cv:
            return self.scheduler.over_bound(full, ratio)

    def wake(self) -> None:
        with self.cv:
            self.cv.notify_all()

    def finished(self) -> Iterable[Completion]:
        """The batches the devices handed back since the last call, in order."""
        while True:
            try:
                yield self.completions.get_nowait()
            except queue.Empty:
                return

    def idle(self) -> bool:
        return self.completions.empty()
