"""One lane's queue: its open windows, its FIFO of closed ("ready") batches, deadlines and counters.

Records enter through the lane's ``MicroBatcher`` (open windows, one per size bucket); a window that
closes by count or ``max_wait`` joins the ready FIFO. ``pop_ready`` takes the next up-to-max live records
from the front of the FIFO (one size bucket): a batch shrunk by expiry, closed by time or cut after an OOM
is topped up from the batches behind it (with size buckets, the later batches of its bucket), so a
backlogged lane always runs full batches. With a token budget (``max_tokens``) a batch also stops at the
first record that would take it over the budget (order within the lane is kept), except that a first
record over the budget goes alone.

Deadlines: a per-lane min-heap on deadline with lazy deletion (``live`` holds the ids of queued records
that have one) finds the expired records in O(log n) each. An expired record leaves the counts at once
but stays in its window or ready batch as a tombstone (``dead``) until it reaches the front (O(1) to drop
there, instead of an O(queue) search now); ``purge_dead`` drops them all in one pass once they outnumber
the lane's live records, which bounds the memory they hold.

Counters: ``n`` is the lane's live records queued (windows + ready batches, tombstones not counted),
``ready_n`` the records physically in ready batches (tombstones included until dropped). Pure, not
thread-safe: the scheduler serializes calls.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Callable, Iterable

from worker.core.batcher import MicroBatcher, cost
from worker.core.lane_settings import LaneSettings
from worker.core.latency import LatencyModel
from worker.core.records import Batch, Record

# Ready batches that a short batch of a size bucket looks through for later records of its bucket (see
# Lane.top_up_bucket): it bounds the time one dispatch spends on a lane that holds thousands of batches.
TOP_UP_SCAN = 256

RATE_TAU_S = 0.2  # time constant of the arrival-rate estimate


class Lane:
    __slots__ = (
        "name", "index", "priority", "weight", "queue_bound", "max_batch", "batcher", "ready", "ready_n", "n",
        "dead", "heap", "live", "seq", "vservice", "served_records", "served_batches", "expired", "revoked",
        "arrivals", "rate", "rate_t", "rate_mark", "rate_num", "rate_den", "model", "hold_until",
        "cfg_max_batch", "fill", "fill_efficiency", "ahead", "max_tokens",
    )

    def __init__(self, cfg: LaneSettings, index: int, bucket_width: int) -> None:
        self.name = cfg.name
        self.index = index
        self.priority = cfg.priority
        self.weight = float(cfg.weight)
        self.queue_bound = cfg.queue_bound
        self.max_batch = cfg.max_batch_size
        self.cfg_max_batch = cfg.max_batch_size
        self.max_tokens = cfg.max_batch_tokens  # the token budget in force (None: none)
        self.fill = cfg.fill_with_lower and bucket_width == 0
        self.fill_efficiency = cfg.fill_efficiency
        self.batcher = MicroBatcher(cfg.name, cfg.max_batch_size, cfg.max_wait_ms / 1000.0, bucket_width,
                                    cfg.max_batch_tokens)
        self.ready: deque[Batch] = deque()
        self.ready_n = 0  # records physically in ready batches (expired ones included until dropped)
        self.n = 0  # live records queued (ready batches + open windows), expired ones not counted
        # id() of expired records already handed out but still physically in a ready batch or window:
        # dropped when they reach the front (O(1) each) instead of searched for now (O(queue)).
        self.dead: set[int] = set()
        self.heap: list[tuple[float, int, Record]] = []  # (deadline, seq, record), lazy deletion
        self.live: set[int] = set()  # id() of queued records that have a deadline
        self.seq = 0  # ties of equal deadlines in the heap go in arrival order
        self.vservice = 0.0  # records served / weight (the fair-share counter)
        self.served_records = 0
        self.served_batches = 0
        self.expired = 0
        self.revoked = 0
        self.arrivals = 0
        self.rate = 0.0
        self.rate_t: float | None = None
        self.rate_mark = 0
        self.rate_num = 0.0  # exponentially decayed arrivals ...
        self.rate_den = 0.0  # ... over exponentially decayed elapsed time: unbiased from the first update
        self.model = LatencyModel()
        self.hold_until: float | None = None
        self.ahead = 0  # batches taken ahead (next_batch(idle=False)) and not started yet

    def queued(self) -> int:
        return self.n

    # ------------------------------------------------------------------ deadlines
    def track_deadline(self, record: Record, deadline: float) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (deadline, self.seq, record))
        self.live.add(id(record))

    def earliest_deadline(self) -> float | None:
        """Earliest deadline among queued records (drops stale heap tops on the way)."""
        heap, live = self.heap, self.live
        while heap:
            d, _, r = heap[0]
            if id(r) in live and r.deadline == d:
                return d
            heapq.heappop(heap)
        return None

    def compact(self) -> None:
        """Rebuild the deadline heap without stale entries once they outnumber live ones."""
        if len(self.heap) > 2 * len(self.live) + 64:
            live = self.live
            self.heap = [e for e in self.heap if id(e[2]) in live and e[2].deadline == e[0]]
            heapq.heapify(self.heap)

    def expire_due(self, now: float, bar: float) -> list[Record]:
        """Tombstone and return the queued records whose deadline is ``<= now`` or below ``bar`` (a predicted
        miss); the caller hands them out."""
        heap = self.heap
        if not heap:
            return []
        top = heap[0][0]
        if top > now and top >= bar:  # nothing due (the top may be stale: harmless)
            return []
        live = self.live
        dead: dict[int, Record] = {}
        while heap:
            d, _, r = heap[0]
            if d > now and d >= bar:
                break
            heapq.heappop(heap)
            rid = id(r)
            if rid in live and r.deadline == d:
                live.discard(rid)
                dead[rid] = r
        if dead:
            self.dead.update(dead)
            self.expired += len(dead)
            self.n -= len(dead)
            # Bound the memory tombstones hold; an all-dead lane is cleared at once (no spurious wake-ups).
            if self.n == 0 or (len(self.dead) > 1024 and len(self.dead) > self.n):
                self.purge_dead()
        return list(dead.values())

    def purge_dead(self) -> None:
        """Physically drop every tombstoned record of the lane (O(records held); amortised O(1) per
        expired record because it runs only once tombstones outnumber live records)."""
        dead = self.dead
        if self.ready_n:
            for b in self.ready:
                b.records = [r for r in b.records if id(r) not in dead]
            self.ready = deque(b for b in self.ready if b.records)
            self.ready_n = sum(len(b.records) for b in self.ready)
        if len(self.batcher):
            self.batcher.remove(lambda r: id(r) in dead)
        dead.clear()

    def drop_tombstones(self, recs: list[Record]) -> list[Record]:
        """``recs`` without the lane's tombstones (forgotten on the way)."""
        dead = self.dead
        if not dead:
            return recs
        kept = []
        for r in recs:
            if id(r) in dead:
                dead.discard(id(r))
            else:
                kept.append(r)
        return kept

    def revoke(self, pred: Callable[[Record], bool]) -> list[Record]:
        """Take the queued records matching ``pred`` out of the ready batches and windows; returns the live
        ones (tombstones matched are forgotten). The caller adjusts the scheduler's total."""
        removed: list[Record] = []
        if self.ready_n:
            for b in self.ready:
                if any(pred(r) for r in b.records):
                    removed.extend(r for r in b.records if pred(r))
                    b.records = [r for r in b.records if not pred(r)]
            self.ready = deque(b for b in self.ready if b.records)
            self.ready_n = sum(len(b.records) for b in self.ready)
        if len(self.batcher):
            removed.extend(self.batcher.remove(pred))
        out: list[Record] = []
        for r in removed:
            rid = id(r)
            if rid in self.dead:  # expired and already handed out
                self.dead.discard(rid)
                continue
            self.live.discard(rid)
            out.append(r)
        self.revoked += len(out)
        self.n -= len(out)
        if self.n == 0 and self.dead:  # only tombstones of other records left: no spurious wake-ups
            self.purge_dead()
        return out

    # ------------------------------------------------------------------ arrivals
    def update_rate(self, now: float) -> None:
        """The arrival-rate estimate (records/s, exponentially smoothed over ``RATE_TAU_S``)."""
        t = self.rate_t
        if t is None:
            self.rate_t = now
            self.rate_mark = self.arrivals
            return
        dt = now - t
        if dt < 1e-3:
            return
        keep = math.exp(-dt / RATE_TAU_S)
        self.rate_num = self.rate_num * keep + (self.arrivals - self.rate_mark)
        self.rate_den = self.rate_den * keep + dt
        self.rate = self.rate_num / self.rate_den
        self.rate_t = now
        self.rate_mark = self.arrivals

    # ------------------------------------------------------------------ ready batches
    def push_ready(self, batches: Iterable[Batch]) -> None:
        for b in batches:
            self.ready.append(b)
            self.ready_n += len(b.records)

    def close_due_windows(self, now: float) -> None:
        """Move the lane's windows that are due (by count or max_wait) to its ready FIFO."""
        if len(self.batcher):
            closed = self.batcher.poll(now)
            if closed:
                self.push_ready(closed)

    def ready_full(self) -> bool:
        """The ready batches hold a full batch: ``max_batch`` records, or the token budget's worth (one
        closed because the next record did not fit it is full too)."""
        if self.ready_n >= self.max_batch:
            return True
        left = self.max_tokens
        if left is None:
            return False
        for b in self.ready:  # fewer than max_batch records in all: O(max_batch)
            if b.reason == "tokens":
                return True
            for r in b.records:
                left -= cost(r)
                if left <= 0:
                    return True
        return False

    def token_room(self, records: list[Record]) -> int | None:
        """What a batch holding ``records`` has left of the lane's token budget (None: no budget)."""
        tok = self.max_tokens
        return None if tok is None else tok - sum(cost(r) for r in records)

    def take_fill(self, now: float, limit: int, tokens: int | None) -> Batch | None:
        """Up to ``limit`` live records and ``tokens`` cost (None: no budget but the lane's) for another
        lane's partial batch: ready batches first, then the open window. None when nothing fits; the
        batch returned may be empty (everything at the front had expired)."""
        if not self.ready_n:
            opened = self.batcher.take_open(now, limit, "fill", tokens)
            if opened is None:
                return None
            self.push_ready([opened])
        batch, blocked = self._pop(limit, tokens)
        return None if blocked and not batch.records else batch

    def pop_ready(self, limit: int | None = None, tokens: int | None = None) -> Batch:
        """The next up-to-max live records from the front of the lane's ready batches (same size bucket):
        expired records are dropped on the way, and a short batch (shrunk by expiry, closed by time, or
        cut after an OOM) is topped up from the batches behind it, so a backlogged lane runs full batches.
        With size buckets the ready FIFO interleaves buckets, so the top-up goes on past batches of other
        buckets to the later batches of its own (see ``top_up_bucket``).

        ``tokens``: the room left in a batch being topped up; a first record that does not fit it is not
        taken. Without it the lane's budget applies, and a first record over it goes alone.
        May return an empty batch (everything at the front had expired, or nothing fits ``tokens``)."""
        return self._pop(limit, tokens)[0]

    def _pop(self, limit: int | None, tokens: int | None) -> tuple[Batch, bool]:
        """``pop_ready``, and whether a record that does not fit the token budget stopped it."""
        m = self.max_batch if limit is None else min(limit, self.max_batch)
        tok = self.max_tokens
        if tokens is not None:
            tok = tokens if tok is None else min(tok, tokens)
        if tok is not None:
            return self._pop_tokens(m, tok, tokens is None)
        ready, dead = self.ready, self.dead
        first = ready[0]
        batcher = self.batcher
        bw = batcher.bucket_width
        bucket = batcher.bucket_of(first.records[0]) if bw else 0
        out: list[Record] = []
        taken = 0
        while ready and len(out) < m:
            b = ready[0]
            recs = b.records
            if bw and b is not first and batcher.bucket_of(recs[0]) != bucket:
                break
            j = take_live(recs, out, m, dead)
            taken += j
            if j == len(recs):
                ready.popleft()
            else:
                del recs[:j]
        if bw and ready and len(out) < m:
            taken += self.top_up_bucket(bucket, out, m)
        self.ready_n -= taken
        return Batch(self.name, out, first.opened_at, first.closed_at, first.reason, m), False

    def _pop_tokens(self, m: int, left: int, lone: bool) -> tuple[Batch, bool]:
        """``_pop`` within a token budget of ``left``; ``lone``: a first record over it goes alone."""
        ready, dead = self.ready, self.dead
        first = ready[0]
        batcher = self.batcher
        bw = batcher.bucket_width
        bucket = batcher.bucket_of(first.records[0]) if bw else 0
        out: list[Record] = []
        taken = 0
        blocked = False
        while ready and len(out) < m and not blocked:
            b = ready[0]
            recs = b.records
            if bw and b is not first and batcher.bucket_of(recs[0]) != bucket:
                break
            j, left, blocked = take_within(recs, out, m, dead, left, lone)
            taken += j
            if j == len(recs):
                ready.popleft()
            else:
                del recs[:j]
        if bw and ready and len(out) < m and not blocked:
            t, blocked = self._top_up_bucket_tokens(bucket, out, m, left)
            taken += t
        self.ready_n -= taken
        return Batch(self.name, out, first.opened_at, first.closed_at, first.reason, m), blocked

    def _top_up_bucket_tokens(self, bucket: int, out: list[Record], m: int, left: int) -> tuple[int, bool]:
        """``top_up_bucket`` within a token budget of ``left``: it stops at the first record of the bucket
        that does not fit (a later, smaller one would overtake it)."""
        ready, dead, batcher = self.ready, self.dead, self.batcher
        taken = 0
        emptied = blocked = False
        for b in itertools.islice(ready, TOP_UP_SCAN):
            recs = b.records
            if batcher.bucket_of(recs[0]) != bucket:
                continue
            j, left, blocked = take_within(recs, out, m, dead, left, False)
            taken += j
            del recs[:j]
            emptied = emptied or not recs
            if len(out) >= m or blocked:
                break
        if emptied:
            self.ready = deque(b for b in ready if b.records)
        return taken, blocked

    def top_up_bucket(self, bucket: int, out: list[Record], m: int) -> int:
        """Moves live records of ``bucket`` from the lane's later ready batches into ``out`` (up to ``m``),
        oldest first; returns how many records it took off the queue (tombstones included).

        Each bucket's window closes by time on its own, so under a backlog the ready FIFO holds a partial
        batch of a bucket, then batches of other buckets, then more of the first bucket: taking the later
        records of the same bucket now runs one full batch instead of two partial ones. They keep their
        order within the bucket (buckets are reordered against each other anyway), and the batches skipped
        over wait no longer than behind a full batch at the front. It looks at the first ``TOP_UP_SCAN``
        ready batches only, so a dispatch costs O(1) however many small batches a lane holds."""
        ready, dead, batcher = self.ready, self.dead, self.batcher
        taken = 0
        emptied = False
        for b in itertools.islice(ready, TOP_UP_SCAN):
            recs = b.records
            if batcher.bucket_of(recs[0]) != bucket:
                continue
            j = take_live(recs, out, m, dead)
            taken += j
            del recs[:j]
            emptied = emptied or not recs
            if len(out) >= m:
                break
        if emptied:
            self.ready = deque(b for b in ready if b.records)
        return taken


def take_live(recs: list[Record], out: list[Record], m: int, dead: set[int]) -> int:
    """Moves records from the front of ``recs`` into ``out`` until it holds ``m``, dropping (and forgetting)
    tombstones on the way. Returns how many records it went through; the caller removes them from ``recs``."""
    j = 0
    for r in recs:
        if len(out) >= m:
            break
        j += 1
        if dead and id(r) in dead:
            dead.discard(id(r))
        else:
            out.append(r)
    return j


def take_within(recs: list[Record], out: list[Record], m: int, dead: set[int], left: int,
                lone: bool) -> tuple[int, int, bool]:
    """``take_live`` within a token budget of ``left``: it stops at the first live record that does not
    fit (with ``lone``, a first record of ``out`` over the budget goes alone). Returns how many records
    it went through, the budget left, and whether a record that does not fit stopped it."""
    j = 0
    for r in recs:
        if len(out) >= m:
            break
        if dead and id(r) in dead:
            dead.discard(id(r))
            j += 1
            continue
        c = r.size if r.size > 1 else 1
        if c > left and not (lone and not out):
            return j, left, True
        j += 1
        left -= c
        out.append(r)
    return j, left, False
