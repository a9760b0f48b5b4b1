"""Streams of random operations played on a ``MicroBatcher`` or a ``PriorityScheduler``, as the runner
drives them, for the property tests of the batching. A play hands each batch that comes out to the test's
check, counts every record that leaves (dispatched, expired, revoked, removed), and at its end drains what
is left and shows that each record added came out exactly once."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from tests.unit.fakes import rec
from worker.core.batcher import MicroBatcher, cost
from worker.core.records import Batch, Record, TopicPartition
from worker.core.scheduler import PriorityScheduler

LANES = ["hi", "lo", "default"]
PRIORITY = {"hi": 5, "lo": 1, "default": 0}


def batch_cost(b: Batch) -> int:
    return sum(cost(r) for r in b.records)


class BatcherPlay:
    """Operations ``(op, arg, dt)`` on one batcher of lane ``L``: ``add`` (a record of size ``arg`` on
    partition ``arg % 4``), ``poll``, ``take`` (at most ``arg`` records), ``fill`` (within ``arg`` tokens),
    ``max``, ``tokens`` (``0``: no budget), ``remove`` (partition ``arg``); ``dt`` seconds pass first.

    Each batch must be non-empty, within the batcher's size and of one size bucket (``bucket`` wide);
    ``check(batch, op, arg)`` adds the test's own rules, with the operation that handed the batch out
    (``flush`` at the end). Records leave each size bucket in the order they came."""

    def __init__(self, b: MicroBatcher, bucket: int, check: Callable[[Batch, str, int], None]) -> None:
        self.b = b
        self.bucket = bucket
        self.check = check
        self.now = 0.0
        self.added: list[int] = []
        self.seen: list[int] = []
        self.order: dict[int, list[int]] = {}  # bucket -> offsets in the order they left in batches

    def _out(self, batches: list[Batch], op: str, arg: int = 0) -> None:
        for x in batches:
            assert x.records, "empty batch"
            assert len(x) <= self.b.max_batch_size
            if self.bucket:
                assert len({r.size // self.bucket for r in x.records}) == 1
            self.check(x, op, arg)
            for r in x.records:
                self.seen.append(r.offset)
                self.order.setdefault(self.b.bucket_of(r), []).append(r.offset)

    def apply(self, op: str, arg: int, dt: float) -> None:
        b = self.b
        self.now += dt
        now = self.now
        if op == "add":
            r = rec("L", size=arg, partition=arg % 4)
            self.added.append(r.offset)
            self._out(b.add(r, now), op, arg)
        elif op == "poll":
            self._out(b.poll(now), op)
            d = b.next_deadline()
            assert d is None or d > now  # everything due was closed
        elif op in ("take", "fill"):
            x = b.take_open(now, arg) if op == "take" else b.take_open(now, 9, "fill", tokens=arg)
            if x is not None:
                self._out([x], op, arg)
        elif op == "max":
            b.set_max_batch_size(arg)
        elif op == "tokens":
            b.set_max_batch_tokens(arg or None)
        elif op == "remove":
            self.seen.extend(r.offset for r in b.remove(lambda r, p=arg: r.tp.partition == p))
        else:
            raise AssertionError(f"unknown operation {op!r}")
        assert len(b) == len(self.added) - len(self.seen)

    def finish(self) -> None:
        self._out(self.b.flush(self.now), "flush")
        assert len(self.b) == 0
        assert sorted(self.seen) == sorted(self.added)
        assert len(set(self.seen)) == len(self.seen)
        for offsets in self.order.values():  # no record overtakes an earlier one of its bucket
            assert offsets == sorted(offsets)


class SchedulerPlay:
    """Operations ``(op, a1, a2, a3)`` on a scheduler of the lanes ``LANES``: ``add`` (a record of lane
    ``LANES[a1]``, size ``a2``, partition ``a2 % 4``, deadline ``a3`` seconds on or none), ``next`` (idle
    ``a1``), ``ahead`` (a full batch taken ahead while the device is busy), ``start`` (the oldest batch taken
    ahead starts as ``Runner._swap`` starts it; nothing when none is), ``tick`` (``a1`` ms), ``expire``,
    ``revoke`` (partition ``a1``), ``max``, ``tokens`` (``0``: no budget), ``observe``, ``flush``.

    Each batch handed out must be non-empty, within its lane's size (a batch taken ahead before the limit
    was lowered keeps its size: the engine splits it), its own lane's records first, then only records of
    lower lanes, none expired, of one size bucket; ``check(batch, taken_ahead)`` adds the test's own rules.
    After each operation the scheduler's counters agree with its structures."""

    def __init__(self, s: PriorityScheduler, bucket: int,
                 check: Callable[[Batch, Batch | None], None]) -> None:
        self.s = s
        self.bucket = bucket
        self.check = check
        self.now = 0.0
        self.added: set[int] = set()
        self.out: list[int] = []
        self.keep: list[Record] = []
        self.pending: deque[Batch] = deque()  # taken ahead, not started yet
        # The lane of the batch taken ahead that the batch being checked preempted (its front records fill
        # the preempting batch first), else None.
        self.donor_lane: str | None = None

    def take(self, b: Batch | None, taken_ahead: Batch | None = None) -> None:
        if b is None:
            return
        s = self.s
        assert b.records, "empty batch"
        assert len(b) <= max(s.max_batch_size(b.lane), len(taken_ahead) if taken_ahead is not None else 0)
        own = [r for r in b.records if r.lane == b.lane]
        assert own and b.records[:len(own)] == own, "the batch's own lane first"
        assert all(PRIORITY[r.lane] < PRIORITY[b.lane] for r in b.records[len(own):]), (
            "filled only from lower lanes")
        now = self.now
        assert all(r.deadline is None or r.deadline > now for r in b.records), "expired record dispatched"
        if self.bucket:
            assert len({r.size // self.bucket for r in b.records}) == 1
        self.check(b, taken_ahead)
        self.out.extend(r.offset for r in b.records)

    def start(self, pre: Batch) -> None:
        """As ``Runner._swap``: start, drop what expired since it was taken, preempt, else top up."""
        s, now = self.s, self.now
        assert s.start(pre), "a batch taken ahead starts as one"
        trimmed = s.drop_expired(pre, now)
        cur = trimmed if trimmed is not None else pre
        if not cur.records:
            return  # every record expired: handed out by the next expire()
        run = s.preempt(cur, now)
        if run is not None:
            self.donor_lane = cur.lane
            try:
                self.take(run)
            finally:
                self.donor_lane = None
            return
        run = s.top_up(cur, now)
        if run is None:
            self.take(cur, taken_ahead=cur)
        else:
            self.take(run)

    def apply(self, op: str, a1: object, a2: int, a3: float | None) -> None:
        s, now = self.s, self.now
        if op == "add":
            r = rec(LANES[int(a1)], partition=a2 % 4, size=a2,  # type: ignore[call-overload]
                    deadline=None if a3 is None else now + a3)
            self.keep.append(r)
            self.added.add(r.offset)
            self.out.extend(x.offset for x in s.add(r, now))
        elif op == "next":
            self.take(s.next_batch(now, idle=bool(a1)))
        elif op == "ahead":
            pre = s.next_batch(now, idle=False, full_only=True)
            if pre is not None:
                self.pending.append(pre)
        elif op == "start":
            if self.pending:
                self.start(self.pending.popleft())
        elif op == "tick":
            self.now += int(a1) / 1000.0  # type: ignore[call-overload]
        elif op == "expire":
            self.out.extend(r.offset for r in s.expire(now))
        elif op == "revoke":
            self.out.extend(r.offset for r in s.revoke({TopicPartition("in", int(a1))}))  # type: ignore[call-overload]
        elif op == "max":
            s.set_max_batch_size(LANES[int(a1)], a2)  # type: ignore[call-overload]
        elif op == "tokens":
            s.set_max_batch_tokens(LANES[int(a1)], a2 or None)  # type: ignore[call-overload]
        elif op == "observe":
            s.observe(LANES[int(a1)], a2, 0.020 + 0.001 * a2)  # type: ignore[call-overload]
        elif op == "flush":
            s.flush(now)
        else:
            raise AssertionError(f"unknown operation {op!r}")
        assert len(s) == sum(s.queued(ln) for ln in LANES)
        for lane in s._lanes.values():  # the O(1) counters agree with the structures
            assert lane.n == len(lane.batcher) + lane.ready_n - len(lane.dead)
            assert lane.ready_n == sum(len(x.records) for x in lane.ready)

    def finish(self) -> None:
        """Starts what was taken ahead, flushes, takes every batch left and expires the rest: each record
        added came out exactly once."""
        s = self.s
        while self.pending:
            self.start(self.pending.popleft())
        s.flush(self.now)
        for _ in range(1000):
            b = s.next_batch(self.now, idle=True)
            if b is None:
                break
            self.take(b)
        self.out.extend(r.offset for r in s.expire(self.now))
        assert len(s) == 0
        assert len(self.out) == len(set(self.out)), "a record came out twice"
        assert set(self.out) == self.added, "a record was lost"
