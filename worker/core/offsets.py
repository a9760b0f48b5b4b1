"""Which offsets are safe to commit when records finish out of order.

Why: lanes, devices and the producer complete records out of order, but a Kafka commit says "everything
before this offset is done". Committing past a record that is still in flight would lose it on a crash
or rebalance. The tracker commits, per partition, only the contiguous done prefix of the offsets it was
asked to track.

Model, per partition:

- ``track(tp, offset)`` when a record is received (``track_run`` for a poll batch's offsets of one
  partition). Offsets increase but may have gaps (compacted topics,
  transaction markers): an untracked offset is not a hole, only a tracked offset that is not done blocks.
- ``ack(tp, offset)`` when its result (or DLQ record) is delivered: it is done.
- ``committable()``: for each partition whose position advanced past the last ``mark_committed``, the
  offset *after* the done prefix, i.e. the first tracked offset not yet done, or the last tracked offset
  + 1 when all are done. That is the value Kafka expects in a commit (the next offset to consume).
- ``detach(tps)`` instead of ``revoke`` when partitions are *lost* (a session expired: nothing could be
  committed): their state is kept aside, ``ack_lost`` goes on marking records done as their results are
  delivered late, and ``take_lost(tp)`` says, when the partition comes back, which offsets it covers and
  how far its done prefix reaches. Every record below that was delivered by this worker, so a consumer
  that finds the group's commit inside that range may go on from there (the runner's
  ``_resume_lost``) instead of processing those records a second time.

Guarantees (checked by property tests): the committable offset never passes a tracked record that is not
done, never goes backwards, and reaches ``last tracked + 1`` once every tracked record is done.

Cost: O(1) amortised per record. Each partition keeps a deque of tracked offsets in order and a set of
the ones not done; ``ack`` pops the done prefix from the front (each offset is popped once).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping
from itertools import islice
from operator import lt

from worker.core.records import TopicPartition


class _Partition:
    __slots__ = ("order", "pending", "started", "last", "committed", "first")

    def __init__(self) -> None:
        self.order: deque[int] = deque()  # tracked offsets not yet popped, increasing; the front is not done
        self.pending: set[int] = set()  # tracked, not done
        # True once the front record completed: before that, committing the first tracked offset would be
        # a no-op, so nothing is offered.
        self.started = False
        self.last = -1  # highest offset tracked
        self.committed: int | None = None  # last value given to mark_committed
        self.first = -1  # first offset tracked: the done prefix covers [first, position())

    def advance(self) -> None:
        order, pending = self.order, self.pending
        while order and order[0] not in pending:
            order.popleft()
        self.started = True

    def position(self) -> int | None:
        """The offset after the done prefix: the first tracked offset not done (untracked offsets before it
        are gaps, not holes), or the last tracked + 1 when all are done."""
        if not self.started:
            return None
        return self.order[0] if self.order else self.last + 1


class OffsetTracker:
    __slots__ = ("_parts", "_in_flight", "_lost")

    def __init__(self) -> None:
        self._parts: dict[TopicPartition, _Partition] = {}
        self._in_flight = 0
        self._lost: dict[TopicPartition, _Partition] = {}  # detached: lost partitions, until they come back

    # ------------------------------------------------------------------ hot path
    def track(self, tp: TopicPartition, offset: int) -> bool:
        """Start tracking a received record. Returns False (and ignores it) for an offset at or below the
        last one tracked on this partition (a redelivery the tracker already accounts for)."""
        p = self._parts.get(tp)
        if p is None:
            p = self._parts[tp] = _Partition()
        if p.first < 0:
            p.first = offset
        if offset <= p.last:
            return False
        p.order.append(offset)
        p.pending.add(offset)
        p.last = offset
        self._in_flight += 1
        return True

    def track_run(self, tp: TopicPartition, offsets: list[int]) -> bool:
        """``track`` for the offsets a poll batch read of one partition, in one call when every one of them
        would be tracked: they increase, and the first is past the last one tracked. Returns False and
        changes nothing otherwise (a position that moved back): the caller tracks them one at a time, since
        what follows a rejected offset depends on what the caller does about it."""
        p = self._parts.get(tp)
        if p is None:
            p = self._parts[tp] = _Partition()
        if offsets[0] <= p.last or (len(offsets) > 1 and not all(map(lt, offsets, islice(offsets, 1, None)))):
            return False
        if p.first < 0:
            p.first = offsets[0]
        p.order.extend(offsets)
        p.pending.update(offsets)
        p.last = offsets[-1]
        self._in_flight += len(offsets)
        return True

    def ack(self, tp: TopicPartition, offset: int) -> bool:
        """Mark a tracked record done. Unknown offsets (revoked partition, duplicate ack) are ignored
        (returns False)."""
        p = self._parts.get(tp)
        if p is None or offset not in p.pending:
            return False
        p.pending.remove(offset)
        self._in_flight -= 1
        if p.order[0] == offset:
            p.advance()
        return True

    def ack_many(self, tp: TopicPartition, offsets: Iterable[int]) -> int:
        """``ack`` for several records of one partition (a delivered batch's run); returns how many were
        tracked and not done. The done prefix is popped once, after all of them."""
        p = self._parts.get(tp)
        if p is None:
            return 0
        pending = p.pending
        n = len(pending)
        pending.difference_update(offsets)
        done = n - len(pending)
        if done:
            self._in_flight -= done
            if p.order[0] not in pending:
                p.advance()
        return done

    # ------------------------------------------------------------------ commits
    def committable(self) -> dict[TopicPartition, int]:
        """Per partition, the offset to commit (next to consume), where it advanced past the last commit."""
        out: dict[TopicPartition, int] = {}
        for tp, p in self._parts.items():
            pos = p.position()
            if pos is None or (p.committed is not None and pos <= p.committed):
                continue
            out[tp] = pos
        return out

    def mark_committed(self, offsets: Mapping[TopicPartition, int]) -> None:
        """Record a successful commit of these offsets (values as returned by ``committable``)."""
        for tp, off in offsets.items():
            p = self._parts.get(tp)
            if p is not None and (p.committed is None or off > p.committed):
                p.committed = off

    # ------------------------------------------------------------------ rebalance
    def assign(self, tps: Iterable[TopicPartition]) -> None:
        """Start fresh state for newly assigned partitions (optional: ``track`` creates it lazily)."""
        for tp in tps:
            old = self._parts.pop(tp, None)
            if old is not None:
                self._in_flight -= len(old.pending)
            self._parts[tp] = _Partition()

    def revoke(self, tps: Iterable[TopicPartition]) -> None:
        """Forget these partitions; later acks for them are ignored."""
        for tp in tps:
            p = self._parts.pop(tp, None)
            if p is not None:
                self._in_flight -= len(p.pending)

    def detach(self, tps: Iterable[TopicPartition]) -> None:
        """Lost partitions: they leave the live state (in flight, commits) like ``revoke``, but what was
        tracked is kept for ``ack_lost`` and ``take_lost`` (replacing what an earlier loss of the same
        partition
        left)."""
        for tp in tps:
            p = self._parts.pop(tp, None)
            if p is not None:
                self._in_flight -= len(p.pending)
                if p.first >= 0:
                    self._lost[tp] = p

    def ack_lost(self, tp: TopicPartition, offset: int) -> bool:
        """A result delivered after its partition was lost: the record is done all the same. Returns whether a
        detached partition was waiting for it."""
        p = self._lost.get(tp)
        if p is None or offset not in p.pending:
            return False
        p.pending.remove(offset)
        if p.order[0] == offset:
            p.advance()
        return True

    def take_lost(self, tp: TopicPartition) -> tuple[int, int] | None:
        """Forget what a loss of ``tp`` left and return ``(first, done)``: every record tracked in
        ``[first, done)`` was done (delivered) by this worker. None when nothing was kept, or nothing done."""
        p = self._lost.pop(tp, None)
        if p is None:
            return None
        done = p.position()
        if done is None or done <= p.first:
            return None
        return p.first, done

    def forget_lost(self) -> None:
        """Drop what every detached partition left (the partitions that did not come back with the rejoin)."""
        self._lost.clear()

    def lost(self) -> list[TopicPartition]:
        """Partitions detached and not taken back yet."""
        return list(self._lost)

    # ------------------------------------------------------------------ introspection
    def in_flight(self) -> int:
        """Tracked records not yet done, all partitions."""
        return self._in_flight

    def span(self, tp: TopicPartition) -> int:
        """Records read from the partition's oldest unfinished one on, done or not: what its commit is behind
        by (the done prefix is popped, so this is the length of what is left)."""
        p = self._parts.get(tp)
        return len(p.order) if p is not None else 0

    def pending(self, tp: TopicPartition) -> int:
        p = self._parts.get(tp)
        return len(p.pending) if p is not None else 0


    def first_pending(self, tp: TopicPartition) -> int | None:
        """The offset blocking the partition's commit (oldest tracked, not done), if any."""
        p = self._parts.get(tp)
        if p is None:
            return None
        return p.order[0] if p.order else None  # the front is always not done (ack pops the done prefix)

    def partitions(self) -> list[TopicPartition]:
        return list(self._parts)

    def committed(self, tp: TopicPartition) -> int | None:
        p = self._parts.get(tp)
        return p.committed if p is not None else None
