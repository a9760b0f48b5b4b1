"""Which lane's batch a free device runs next: priorities, weighted fair shares, deadlines, adaptive waits.

Why: lanes (e.g. ``interactive`` and ``bulk``) share the devices. Interactive work should go first, bulk
work must never starve, records past their deadline must never reach the model, and an idle device should
not sit waiting for a window to fill when waiting cannot pay off.

Structure: one ``MicroBatcher`` per lane (open windows) plus a FIFO of closed ("ready") batches per lane.
The runner ``add``s records, and each time a device is free it asks ``next_batch(now, idle=...)``. A
dispatched batch is the next up-to-``max_batch_size`` live records at the front of the lane's ready FIFO
(one size bucket): a batch shrunk by expiry, closed by time or cut after an OOM is topped up from the
batches behind it (with size buckets, the later batches of its bucket), so a backlogged lane always runs full
batches.

Choosing a lane (both policies)
-------------------------------
Each lane ``i`` keeps a normalized service counter ``v_i``: the records it was served divided by its
``weight``. *Candidates* are the lanes with dispatchable work: a ready batch, or (``idle=True`` only) an
open window. A candidate is *eligible* when ``v_i < v_min + L``, where ``v_min`` is the smallest ``v`` among
candidates and ``L = max_j(max_batch_size_j / weight_j)`` (one batch of lag, in normalized units). The
eligible lane with the highest ``priority`` is served (ties: the lane listed first in the config); it gets
its oldest ready batch, or, if it has none and the device is idle, its oldest open window (work-conserving:
an idle device never waits out ``max_wait`` when there is work). A lane that becomes backlogged starts at
``v_i = max(v_i, v_min of the backlogged lanes)``: idle time earns no credit to burst with later.

Fairness guarantee. While a set ``S`` of lanes stays backlogged (each always has a ready batch, i.e. under
overload), every lane is served at most one batch past ``v_min + L``, so ``|v_i - v_j| < 2L`` for
``i, j`` in ``S`` at all times. Hence over any such interval in which ``T`` records are served in total,
lane ``i`` gets at least ``T * w_i / W - 4 * L * w_i`` of them (``W`` = sum of the weights in ``S``): its
weighted share ``w_i / W`` minus a constant of a few batches, whatever the priorities. Priority decides
who goes first within that lag: when both lanes are backlogged the high lane is served first and then
they alternate in proportion to their weights (high ``weight`` for the interactive lane gives it most of
the device under overload; ``weight: 1`` everywhere splits the device evenly).

Filling partial batches (lane option ``fill_with_lower``, both policies)
-----------------------------------------------------------------------
A batch that a free device starts now (``next_batch(idle=True)``, or the one ``preempt`` swaps in) whose
lane has the option and that holds fewer than the lane's ``max_batch_size`` records takes the oldest live
records of lower-priority lanes into the free slots: higher priority first, each lane's ready batches and
then its open windows. In ``preempt`` the displaced batch's front records go first (they are the oldest of
their lane, already accounted for; the rest is requeued). Each added record keeps its lane and is charged to
its lane's service counter, so the fairness bound above holds per lane; the batch is marked ``mixed``. Why:
a high lane whose windows close by time under overload otherwise runs batches of a few records whose fixed
cost takes most of the device (``tests/bench/overload_sim``: 0.49 of capacity served at a 10 ms window, 1.00
with the option). A batch taken ahead is full, or is a lane's partial batch owed the device: that one is
topped up from its own lane and then filled when its device starts it (``top_up``). With size buckets the
option is off.
Adaptive policy: the fill stops where the batch's earliest deadline would be missed (``a + b*n``), and a
lower lane whose earliest deadline the filled batch would miss is skipped, so no record is expired on a
filled batch's account.

Deadlines (both policies)
-------------------------
A record whose ``deadline`` is ``<= now`` is expired: ``add`` hands it straight back, ``expire(now)``
returns queued ones (found through a per-lane min-heap on deadline, O(log n) per record), and
``next_batch`` expires first, so no expired record is ever returned in a batch. Records expired by
``next_batch`` itself are handed out by the next ``expire`` call. A batch taken ahead can age past its
records' deadlines before its device starts it: ``drop_expired`` takes those out at the start. An expired record leaves the counts at
once but stays in its window or ready batch as a tombstone until it reaches the front (O(1) to drop
there, instead of an O(queue) search now); tombstones are purged in one pass once they outnumber the live
records of their lane, which bounds the memory they hold.

Policy "fixed"
--------------
Windows close by count or ``max_wait``; an idle device takes the best open window at once.

Policy "adaptive" (the latency predictor and adaptive timeout of design seed 000)
--------------------------------------------------------------------------------
Per lane an online least-squares fit ``latency(n) = a + b*n`` (``LatencyModel``, fed by ``observe``; a
pooled model stands in for lanes without enough observations) and an arrival-rate estimate ``lam``
(records/s, exponentially smoothed).

- *Wait or go*: with ``k`` records open and the device idle, dispatching now yields ``k / (a + b k)``
  records/s; waiting ``t`` yields ``(k + lam t) / (t + a + b (k + lam t))``. That function of ``t`` is
  monotone and increases exactly when ``lam * a > k``, so the scheduler holds the window until it should be
  full (``(B - k) / lam``), capped by the window's ``max_wait`` and by every queued record's deadline
  (the lane's earliest deadline must still be met after the wait plus the batch; other lanes' earliest
  deadlines after that plus their own batch); otherwise it dispatches now (reason ``"adaptive"``). While
  holding, another lane's batch that is predicted to finish before the hold ends is served in the gap.
- *Expire early*: a record whose deadline falls before ``now + a + b`` cannot make it even alone and is
  expired now; at dispatch the batch keeps the largest set of records that all meet
  ``deadline >= now + a + b * n_kept`` (records without deadline always stay), the rest are expired
  rather than sent to the model to produce a late answer.

Until a model has ``min_obs`` observations, "adaptive" behaves exactly like "fixed".

Pure: ``now`` is passed in (monotonic seconds, non-decreasing); no clocks, threads or I/O. Not
thread-safe: the runner serializes calls. Costs: ``add`` O(1) (+ O(log n) with a deadline), ``next_batch``
O(lanes + batch size), expiry O(log n) amortised per record, ``revoke`` O(records queued). Measured at
about 1-3 us per record for add + dispatch (batches of 32, CPython 3.11, a busy shared VM).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from collections.abc import Collection, Iterable, Sequence
from typing import Any, Literal

from worker.config import LaneConfig
from worker.core.batcher import MicroBatcher
from worker.core.latency import LatencyModel
from worker.core.records import Batch, Record, TopicPartition

# Ready batches that a short batch of a size bucket looks through for later records of its bucket (see
# PriorityScheduler._top_up_bucket): ~20 us at most per batch dispatched.
TOP_UP_SCAN = 256

Policy = Literal["fixed", "adaptive"]

RATE_TAU_S = 0.2  # time constant of the arrival-rate estimate
MIN_HOLD_S = 1e-4  # an adaptive wait shorter than this is not worth a wake-up


class _Lane:
    __slots__ = (
        "name", "index", "priority", "weight", "queue_bound", "max_batch", "batcher", "ready", "ready_n", "n", "dead",
        "heap", "live", "vservice", "served_records", "served_batches", "expired", "revoked", "arrivals",
        "rate", "rate_t", "rate_mark", "rate_num", "rate_den", "model", "hold_until", "cfg_max_batch", "fill",
        "ahead",
    )

    def __init__(self, cfg: LaneConfig, index: int, bucket_width: int) -> None:
        self.name = cfg.name
        self.index = index
        self.priority = cfg.priority
        if not cfg.weight > 0:
            raise ValueError(f"lane {cfg.name!r}: weight must be > 0, got {cfg.weight}")
        self.weight = float(cfg.weight)
        self.queue_bound = cfg.queue_bound
        self.max_batch = cfg.max_batch_size
        self.cfg_max_batch = cfg.max_batch_size
        self.fill = cfg.fill_with_lower and bucket_width == 0
        self.batcher = MicroBatcher(cfg.name, cfg.max_batch_size, cfg.max_wait_ms / 1000.0, bucket_width)
        self.ready: deque[Batch] = deque()
        self.ready_n = 0  # records physically in ready batches (expired ones included until dropped)
        self.n = 0  # live records queued (ready batches + open windows), expired ones not counted
        # id() of expired records already handed out but still physically in a ready batch or window:
        # dropped when they reach the front (O(1) each) instead of searched for now (O(queue)).
        self.dead: set[int] = set()
        self.heap: list[tuple[float, int, Record]] = []  # (deadline, seq, record), lazy deletion
        self.live: set[int] = set()  # id() of queued records that have a deadline
        self.vservice = 0.0
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


class PriorityScheduler:
    def __init__(self, lanes: Sequence[LaneConfig], default_lane: str, policy: Policy | str = "fixed",
                 bucket_width: int = 0) -> None:
        if not lanes:
            raise ValueError("at least one lane is required")
        names = [lane.name for lane in lanes]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate lane names: {dupes}")
        if default_lane not in names:
            raise ValueError(f"default_lane {default_lane!r} is not one of the lanes {names}")
        if policy not in ("fixed", "adaptive"):
            raise ValueError(f"policy must be 'fixed' or 'adaptive', got {policy!r}")
        self.default_lane = default_lane
        self.policy = policy
        self._adaptive = policy == "adaptive"
        self._lanes: dict[str, _Lane] = {c.name: _Lane(c, i, bucket_width) for i, c in enumerate(lanes)}
        # Preference order: higher priority first, ties by config order.
        self._order: list[_Lane] = sorted(self._lanes.values(), key=lambda ln: (-ln.priority, ln.index))
        self._global_model = LatencyModel()
        self._pending_expired: list[Record] = []
        self._total = 0
        self._seq = 0
        self._deadlines_seen = False  # a record with a deadline was ever queued (drop_expired: else nothing to check)
        self._lag = 0.0
        self._update_lag()

    # ------------------------------------------------------------------ routing
    def lane_for(self, topic: str, header_priority: str | None, field_priority: str | None,
                 topic_lanes: dict[str, str]) -> tuple[str, bool]:
        """The lane for a record: the ``x-priority`` header wins, then the request's ``priority`` field, then
        the topic's lane, else the default lane. The first of those that is set decides; if it names no
        configured lane the record goes to the default lane and the second value is True (count/log it)."""
        for wanted in (header_priority, field_priority):
            if wanted is not None:
                wanted = wanted.strip()
                if wanted:
                    return (wanted, False) if wanted in self._lanes else (self.default_lane, True)
        lane = topic_lanes.get(topic)
        if lane is None:
            return self.default_lane, False
        return (lane, False) if lane in self._lanes else (self.default_lane, True)

    @property
    def lanes(self) -> list[str]:
        return list(self._lanes)

    # ------------------------------------------------------------------ intake
    def add(self, record: Record, now: float) -> list[Record]:
        """Queue ``record`` in ``record.lane`` (an unknown lane name is rewritten to the default lane).
        Returns ``[record]`` if it is already past its deadline (not queued), else ``[]``."""
        lane = self._lanes.get(record.lane)
        if lane is None:
            record.lane = self.default_lane
            lane = self._lanes[self.default_lane]
        d = record.deadline
        if d is not None and d <= now:
            lane.expired += 1
            return [record]
        if lane.dead and id(record) in lane.dead:  # the same object is back while its tombstone is queued
            self._purge_dead(lane)
        if lane.n == 0 and not lane.ahead:
            # (A lane whose records are all in a batch taken ahead is still backlogged: raising its service to
            # the others' would wipe out the lag that made its batch owed, and a preempted batch would then
            # be preempted again at every start until it is full.)
            self._becomes_backlogged(lane, now)
        closed = lane.batcher.add(record, now)
        if closed:
            self._push_ready(lane, closed)
        if d is not None:
            self._track_deadline(lane, record, d)
        lane.n += 1
        self._total += 1
        lane.arrivals += 1
        return []

    def _track_deadline(self, lane: _Lane, record: Record, deadline: float) -> None:
        self._deadlines_seen = True
        self._seq += 1
        heapq.heappush(lane.heap, (deadline, self._seq, record))
        lane.live.add(id(record))

    def _becomes_backlogged(self, lane: _Lane, now: float) -> None:
        if lane.rate_t is None:
            lane.rate_t = now
        if self._total == 0:
            for ln in self._order:  # nobody backlogged: start a fresh fairness epoch
                ln.vservice = 0.0
            return
        others = [ln.vservice for ln in self._order if ln is not lane and ln.n]
        if others:
            lane.vservice = max(lane.vservice, min(others))

    def _close_due_windows(self, lane: _Lane, now: float) -> None:
        """Move the lane's windows that are due (by count or max_wait) to its ready FIFO."""
        if len(lane.batcher):
            closed = lane.batcher.poll(now)
            if closed:
                self._push_ready(lane, closed)

    def _push_ready(self, lane: _Lane, batches: Iterable[Batch]) -> None:
        for b in batches:
            lane.ready.append(b)
            lane.ready_n += len(b.records)

    # ------------------------------------------------------------------ dispatch
    def next_batch(self, now: float, idle: bool = True, full_only: bool = False) -> Batch | None:
        """The batch a free device should run now, or None.

        ``idle=True``: the device has nothing else to do, so an open window is dispatched rather than left
        to fill (fixed policy always; adaptive unless waiting pays, see the module docstring).
        ``idle=False``: only closed batches (e.g. prefetching while the device is still busy).
        ``full_only=True`` (with ``idle=False``): only a lane with a full batch ready. Prefetching a partial
        batch would make every record of its lane that arrives while the device is busy wait behind it; left
        alone, a partial batch is topped up until the device is free. Priority among prefetched batches is
        settled when the device is about to start one: see ``preempt``."""
        self._expire_due(now)
        if self._total == 0:
            return None
        adaptive = self._adaptive
        for lane in self._order:
            self._close_due_windows(lane, now)
            if adaptive:
                self._update_rate(lane, now)
                if idle:
                    lane.hold_until = None
        while self._total:
            batch = self._select(now, idle, full_only)
            if batch is None:
                return None
            batch = self._finalize(batch, now)
            if batch is not None:
                # Only a batch the device starts now is filled: one taken ahead is full, or is filled when
                # its device starts it (top_up).
                if idle:
                    return self._fill(batch, now)
                batch.ahead = True
                self._lanes[batch.lane].ahead += 1
                return batch
        return None

    def _fill(self, batch: Batch, now: float, donor: Batch | None = None) -> Batch:
        """Lane option ``fill_with_lower``: the free slots of a partial batch take the oldest live records of
        lower-priority lanes (ready batches first, then open windows; higher priority first). With ``donor``
        (a lower lane's batch taken ahead, being preempted) its front records go first: they are the oldest,
        and they were accounted for when it was taken. Each record keeps its own lane and is charged to it."""
        lane = self._lanes[batch.lane]
        room = lane.max_batch - len(batch.records)
        if not lane.fill or room <= 0:
            return batch
        model = self._model(lane) if self._adaptive else None
        if model is not None:
            room = self._fill_room(model, batch, now, room)
            if room <= 0:
                return batch
        added: list[Record] = []
        if donor is not None and self._lanes[donor.lane].priority < lane.priority:
            take = donor.records[:room]
            # (adaptive: not if one of them would miss its deadline in the filled batch; they stay in theirs)
            end = now + model.predict(len(batch.records) + len(take)) if model is not None else None
            if end is None or all(r.deadline is None or r.deadline >= end for r in take):
                del donor.records[:room]
                added.extend(take)
                room -= len(take)
        for other in self._order:
            if room <= 0:
                break
            if other.priority >= lane.priority or not other.n:
                continue
            if model is not None:
                # A lane whose earliest deadline the filled batch would miss is left alone: its records
                # may still make it in a batch of their own, and must not be expired for this one.
                # Both models: the leading lane's (the batch's length) and the lower lane's own, which is what
                # its records are held to when they are taken (_finalize -> _drop_misses).
                d = other.earliest_deadline()
                if d is not None:
                    n_all = len(batch.records) + len(added) + room
                    own = self._model(other)
                    end = now + max(model.predict(n_all), own.predict(n_all) if own is not None else 0.0)
                    if d < end:
                        continue
            while room > 0 and other.n:
                if not other.ready_n:
                    opened = other.batcher.take_open(now, room, "fill")
                    if opened is None:
                        break
                    self._push_ready(other, [opened])
                part = self._finalize(self._pop_ready(other, room), now, ahead=len(batch.records) + len(added))
                if part is not None:
                    added.extend(part.records)
                    room -= len(part.records)
        if added:
            batch.records.extend(added)
            batch.mixed = True
        return batch

    def _select(self, now: float, idle: bool, full_only: bool = False) -> Batch | None:
        if full_only and not idle:
            lane_or_none = self._select_ahead()
            if lane_or_none is None:
                return None
            return self._select_from(lane_or_none, now, idle)
        cands = [ln for ln in self._order if ln.ready_n or (idle and ln.n)]
        if not cands:
            return None
        lane = self._eligible(cands)
        if lane.ready_n:
            return self._select_from(lane, now, idle)
        if not self._adaptive:
            return lane.batcher.take_open(now, lane.max_batch, "idle")
        hold = self._hold_until(lane, now)
        if hold is None:
            return lane.batcher.take_open(now, lane.max_batch, "adaptive")
        lane.hold_until = hold
        # Fill the gap: a batch of another lane that finishes before the hold ends delays nobody.
        rest = [ln for ln in cands if ln is not lane]
        limit = self._lag_limit(cands)
        rest.sort(key=lambda ln: (ln.vservice >= limit, -ln.priority, ln.index))
        for other in rest:
            if other.ready_n:
                n = min(len(other.ready[0].records), other.max_batch)
            else:
                peek = other.batcher.peek_oldest()
                assert peek is not None
                n = min(len(peek[1]), other.max_batch)
            if now + self._predict(other, n) <= hold:
                if other.ready_n:
                    return self._pop_ready(other)
                return other.batcher.take_open(now, other.max_batch, "adaptive")
        return None

    @staticmethod
    def _fill_room(model: LatencyModel, batch: Batch, now: float, room: int) -> int:
        """Adaptive: at most ``room`` records, and no more than fit before the batch's earliest deadline."""
        earliest = min((r.deadline for r in batch.records if r.deadline is not None), default=None)
        if earliest is None or model.b <= 0 or not math.isfinite(earliest):
            return room
        return min(room, math.floor((earliest - now - model.a) / model.b) - len(batch.records))

    def _select_ahead(self) -> _Lane | None:
        """The lane whose batch is taken ahead (the device is still busy), or None.

        Full batches are taken ahead; a partial one normally is not: taken now, it would leave behind every
        record of its lane arriving while the device is busy (a higher-priority partial batch goes through
        ``preempt`` when the device is about to start). But the fair-share rule still counts the lanes
        with partial batches: under overload the device never becomes idle, so a lane whose windows close by
        time with a few records would otherwise never run while other lanes keep filling batches. When no
        lane with a full batch is within one batch of lag of the least-served lane with ready work, that
        lane's partial batch is owed the device and goes now."""
        cands = [ln for ln in self._order if ln.ready_n]
        full = [ln for ln in cands if ln.ready_n >= ln.max_batch]
        if not full:
            return None  # the device takes a partial batch when it is free (work-conserving)
        limit = self._lag_limit(cands)
        owed = next((ln for ln in full if ln.vservice < limit), None)
        return owed if owed is not None else self._eligible(cands)

    def _lag_limit(self, cands: list[_Lane]) -> float:
        """A candidate is eligible while its normalized service is below this: one batch of lag."""
        return min(ln.vservice for ln in cands) + self._lag

    def _eligible(self, cands: list[_Lane]) -> _Lane:
        """The lane to serve among the candidates (in priority order): the first within one batch of lag
        of the least-served one (see "Choosing a lane")."""
        limit = self._lag_limit(cands)
        lane = next((ln for ln in cands if ln.vservice < limit), None)
        if lane is None:  # only reachable through float rounding on huge counters
            lane = min(cands, key=lambda ln: ln.vservice)
        return lane

    def start(self, batch: Batch) -> bool:
        """The device is about to start ``batch`` (before ``drop_expired``, ``preempt`` and ``top_up``): a batch
        taken ahead no longer counts as its lane's waiting work. Called for every batch; a no-op for others.
        Returns whether ``batch`` was taken ahead (only such a batch is topped up at its start: one a free
        device took was topped up and filled then)."""
        if not batch.ahead:
            return False
        batch.ahead = False
        lane = self._lanes.get(batch.lane)
        if lane is not None and lane.ahead > 0:
            lane.ahead -= 1
        return True

    def preempt(self, batch: Batch, now: float) -> Batch | None:
        """A device is about to start ``batch``, which it took earlier (prefetched while it was busy). If a lane
        of higher priority than ``batch``'s has a closed batch (its window closed by count or ``max_wait``) and
        is the lane ``next_batch(now, idle=True)`` would serve first, that lane's batch is returned (topped up
        from its open window) and ``batch`` goes back to the front of its lane as if it had never been taken
        (counts, fair-share service, deadlines). Else None: run ``batch``.

        Why: a prefetched batch is taken up to one batch-time before the device can start it; under overload
        that is always a full low-priority batch, so a high-priority record would wait for two low batches
        (the running one and the prefetched one) instead of one. A window still open is not taken early: it
        goes after ``batch`` with the records that arrive meanwhile, which keeps high-priority batches from
        shrinking to a record or two and eating the device's time in fixed costs under overload."""
        own = self._lanes.get(batch.lane)
        if own is None or not batch.records or batch.mixed:
            # (mixed: a free device's batch filled from lower lanes (one taken ahead is never filled). Its
            # records would go back under the filling lane's counts and service; it runs.)
            return None
        if not any(ln.n and ln.priority > own.priority for ln in self._order):
            return None  # the common case: nothing of higher priority is queued
        self._expire_due(now)
        for ln in self._order:
            if ln.priority > own.priority:
                self._close_due_windows(ln, now)
        # Who would an idle device serve? (the rule of _select; ``own`` counted with ``batch`` served, the
        # state in which a lane that became backlogged since was placed, so the lag bound grows by at most
        # one batch)
        pick = self._eligible([ln for ln in self._order if ln is own or ln.n])
        if pick.priority <= own.priority:
            return None
        if not pick.ready_n:
            return None  # its window is still open: it goes after ``batch``, with what arrives meanwhile
        out = self._finalize(self._select_from(pick, now, idle=True), now)
        if out is None:
            return None
        out = self._fill(out, now, donor=batch)
        if batch.records:
            self._requeue(own, batch)
        return out

    def top_up(self, batch: Batch, now: float) -> Batch | None:
        """A device is about to start ``batch``, taken ahead, and ``preempt`` kept it. A partial one (a lane
        owed the device goes with what its windows closed by time, see ``_select_ahead``) takes what its lane
        received since, ready batches first and then the open window, as a free device's batch does
        (``_select_from``); then, with ``fill_with_lower``, lower lanes' records (``_fill``). Returns a new
        batch holding them, which the device prepares again, or None when nothing was added (a full batch,
        size buckets, nothing waiting).

        Why: such a batch was taken up to a batch-time before its device could start it. Without this, its
        lane's records arriving meanwhile would wait for a batch of their own, and a fill lane's free slots
        would stay empty: with a 50 ms high-lane window under 2x overload the high lane's batches were taken
        this way, unfilled, and 0.84 of capacity was served (``tests/bench/overload_sim --fill``)."""
        lane = self._lanes.get(batch.lane)
        if lane is None or lane.batcher.bucket_width or not batch.records:
            return None
        room = lane.max_batch - len(batch.records)
        if room <= 0 or not (lane.n or (lane.fill and self._total)):
            return None
        self._expire_due(now)
        out = batch.with_records(list(batch.records))
        model = self._model(lane) if self._adaptive else None
        if model is not None:
            room = self._fill_room(model, out, now, room)
        if room > 0 and lane.n:
            part = self._finalize(self._select_from(lane, now, True, room), now, ahead=len(out.records))
            if part is not None:
                out.records.extend(part.records)
                lane.served_batches -= 1  # part of this batch, not one of its own
        out = self._fill(out, now)
        return out if len(out.records) > len(batch.records) else None

    def drop_expired(self, batch: Batch, now: float) -> Batch | None:
        """A batch taken ahead waits up to a batch-time before its device starts it; records whose deadline
        passed meanwhile must not reach the model. Returns None when none did. Otherwise a new batch of the
        live records (possibly empty), which the device prepares again; the expired ones are handed out by
        the next ``expire``, and their lanes are not charged for them."""
        if not self._deadlines_seen:
            return None
        live: list[Record] = []
        for r in batch.records:
            if r.deadline is None or r.deadline > now:
                live.append(r)
                continue
            ln = self._lanes.get(r.lane) or self._lanes[batch.lane]  # a filled batch: each record's own lane
            ln.expired += 1
            ln.served_records -= 1
            ln.vservice -= 1 / ln.weight
            self._pending_expired.append(r)
        return batch.with_records(live) if len(live) < len(batch.records) else None

    def _requeue(self, lane: _Lane, batch: Batch) -> None:
        """Undo ``_finalize`` for a dispatched batch and put it back at the front of its lane."""
        n = len(batch.records)
        # (no _becomes_backlogged: the lane's service goes back to what it was before the batch was taken)
        lane.ready.appendleft(batch)
        lane.ready_n += n
        lane.n += n
        self._total += n
        lane.served_records -= n
        lane.served_batches -= 1
        lane.vservice -= n / lane.weight
        for r in batch.records:
            if r.deadline is not None:
                self._track_deadline(lane, r, r.deadline)

    def _select_from(self, lane: _Lane, now: float, idle: bool, limit: int | None = None) -> Batch:
        """The lane's next ready batch of at most ``limit`` records (default ``max_batch_size``); it has a ready
        batch, or, with ``idle``, an open window."""
        m = lane.max_batch if limit is None else limit
        if idle and lane.ready_n < m and len(lane.batcher):
            # Work-conserving top-up: a partial batch (closed by time while the device was busy) takes
            # along the records that arrived since, instead of leaving them for the next round.
            extra = lane.batcher.take_open(now, m - lane.ready_n, "idle")
            if extra is not None:
                self._push_ready(lane, [extra])
        return self._pop_ready(lane, limit)

    def _pop_ready(self, lane: _Lane, limit: int | None = None) -> Batch:
        """The next up-to-max live records from the front of the lane's ready batches (same size bucket):
        expired records are dropped on the way, and a short batch (shrunk by expiry, closed by time, or
        cut after an OOM) is topped up from the batches behind it, so a backlogged lane runs full batches.
        With size buckets the ready FIFO interleaves buckets, so the top-up goes on past batches of other
        buckets to the later batches of its own (see ``_top_up_bucket``).
        May return an empty batch (everything at the front had expired)."""
        m = lane.max_batch if limit is None else min(limit, lane.max_batch)
        ready, dead = lane.ready, lane.dead
        first = ready[0]
        batcher = lane.batcher
        bw = batcher.bucket_width
        bucket = batcher.bucket_of(first.records[0]) if bw else 0
        out: list[Record] = []
        taken = 0
        while ready and len(out) < m:
            b = ready[0]
            recs = b.records
            if bw and b is not first and batcher.bucket_of(recs[0]) != bucket:
                break
            j = _take_live(recs, out, m, dead)
            taken += j
            if j == len(recs):
                ready.popleft()
            else:
                del recs[:j]
        if bw and ready and len(out) < m:
            taken += self._top_up_bucket(lane, bucket, out, m)
        lane.ready_n -= taken
        return Batch(lane.name, out, first.opened_at, first.closed_at, first.reason, m)

    def _top_up_bucket(self, lane: _Lane, bucket: int, out: list[Record], m: int) -> int:
        """Moves live records of ``bucket`` from the lane's later ready batches into ``out`` (up to ``m``),
        oldest first; returns how many records it took off the queue (tombstones included).
        Why: each bucket's window closes by time on its own, so under a backlog the ready FIFO holds a partial
        batch of a bucket, then batches of other buckets, then more of the first bucket. Stopping at the first
        other bucket ran the partial batch as it was, and its bucket's later records in another partial batch:
        1,000 all-MiniLM texts at ``bucket_width`` 8 and max batch 64 took 26 batches, 20 with this (1-2% more
        texts/s on a CPU, where a batch's fixed cost is small). Taking later records of the same
        bucket earlier keeps their order within the bucket (buckets are reordered against each other anyway)
        and delays the batches skipped over by no more than a full batch at the front would.
        It looks at the first ``TOP_UP_SCAN`` ready batches only: a backlogged lane can hold thousands of small
        batches, and a batch whose bucket has nothing behind it scanned them all (5,000 ready batches of one
        record, every one of its own bucket: 199 us per batch dispatched, quadratic in the backlog)."""
        ready, dead, batcher = lane.ready, lane.dead, lane.batcher
        taken = 0
        emptied = False
        for b in itertools.islice(ready, TOP_UP_SCAN):
            recs = b.records
            if batcher.bucket_of(recs[0]) != bucket:
                continue
            j = _take_live(recs, out, m, dead)
            taken += j
            del recs[:j]
            emptied = emptied or not recs
            if len(out) >= m:
                break
        if emptied:
            lane.ready = deque(b for b in ready if b.records)
        return taken

    def _finalize(self, batch: Batch, now: float, ahead: int = 0) -> Batch | None:
        """Account for a batch leaving the queue; adaptive: drop records predicted to miss their deadline
        (``ahead``: records the device runs with them, a batch being filled). Returns None when nothing is
        left to send."""
        lane = self._lanes[batch.lane]
        recs = batch.records
        dead = lane.dead
        if dead:  # tombstones in a window taken early
            kept = []
            for r in recs:
                if id(r) in dead:
                    dead.discard(id(r))
                else:
                    kept.append(r)
            recs = batch.records = kept
        live = lane.live
        if self._adaptive and live:
            model = self._model(lane)
            if model is not None:
                recs = self._drop_misses(lane, recs, now, model, ahead)
                batch.records = recs
        n = len(recs)
        self._total -= n  # (dropped records were accounted for in _drop_misses)
        lane.n -= n
        if lane.n == 0 and dead:
            # Tombstones left in an open window with nothing live behind them kept its close time in
            # next_wakeup, overdue for good: the device's wait turned into a busy loop on the lock.
            self._purge_dead(lane)
        if live:
            for r in recs:
                if r.deadline is not None:
                    live.discard(id(r))
            lane.compact()
        if n == 0:
            return None
        lane.served_records += n
        lane.served_batches += 1
        lane.vservice += n / lane.weight
        lane.hold_until = None
        return batch

    def _drop_misses(self, lane: _Lane, recs: list[Record], now: float, model: LatencyModel,
                     ahead: int = 0) -> list[Record]:
        a, b = model.a, model.b
        a += b * ahead  # the records already in the batch lengthen it as much as these do
        n = len(recs)
        earliest = min((r.deadline for r in recs if r.deadline is not None), default=None)
        if earliest is None or earliest >= now + a + b * n:
            return recs
        # Largest kept set such that every kept deadline >= now + a + b * kept: records without deadline
        # always stay; then the latest deadlines first (kept deadlines fall while the bar rises, so the
        # first failure ends the search).
        timed = sorted((r for r in recs if r.deadline is not None), key=lambda r: r.deadline or 0.0, reverse=True)
        k = n - len(timed)
        keep_ids: set[int] = set()
        for r in timed:
            assert r.deadline is not None
            if r.deadline >= now + a + b * (k + 1):
                k += 1
                keep_ids.add(id(r))
            else:
                break
        kept: list[Record] = []
        for r in recs:
            if r.deadline is None or id(r) in keep_ids:
                kept.append(r)
            else:
                lane.live.discard(id(r))
                lane.expired += 1
                self._total -= 1
                lane.n -= 1
                self._pending_expired.append(r)
        return kept

    # ------------------------------------------------------------------ adaptive policy
    def _model(self, lane: _Lane) -> LatencyModel | None:
        if lane.model.ready:
            return lane.model
        if self._global_model.ready:
            return self._global_model
        return None

    def _predict(self, lane: _Lane, n: int) -> float:
        model = self._model(lane)
        return model.predict(n) if model is not None else 0.0

    def _update_rate(self, lane: _Lane, now: float) -> None:
        t = lane.rate_t
        if t is None:
            lane.rate_t = now
            lane.rate_mark = lane.arrivals
            return
        dt = now - t
        if dt < 1e-3:
            return
        keep = math.exp(-dt / RATE_TAU_S)
        lane.rate_num = lane.rate_num * keep + (lane.arrivals - lane.rate_mark)
        lane.rate_den = lane.rate_den * keep + dt
        lane.rate = lane.rate_num / lane.rate_den
        lane.rate_t = now
        lane.rate_mark = lane.arrivals

    def _hold_until(self, lane: _Lane, now: float) -> float | None:
        """When to dispatch the lane's oldest open window if waiting for more records pays, else None."""
        model = self._model(lane)
        peek = lane.batcher.peek_oldest()
        if model is None or peek is None:
            return None
        a, b = model.a, model.b
        opened_at, recs = peek
        k = len(recs)
        cap = lane.max_batch
        lam = lane.rate
        if k >= cap or lam * a <= k:
            return None  # waiting cannot raise throughput
        t = min(opened_at + lane.batcher.max_wait_s - now, (cap - k) / lam)
        denom = 1.0 + b * lam  # latency grows with the records that arrive while waiting
        for other in self._order:
            d = other.earliest_deadline()
            if d is None:
                continue
            extra = 0.0 if other is lane else self._predict(other, min(other.queued(), other.max_batch))
            t = min(t, (d - now - a - b * k - extra) / denom)
        if t < MIN_HOLD_S:
            return None
        return now + t

    def observe(self, lane: str, n: int, seconds: float) -> None:
        """Feed the latency model with a finished batch: ``n`` records took ``seconds`` on the device."""
        ln = self._lanes.get(lane)
        if ln is not None:
            ln.model.observe(n, seconds)
        self._global_model.observe(n, seconds)

    # ------------------------------------------------------------------ expiry
    def expire(self, now: float) -> list[Record]:
        """Remove and return queued records past their deadline (adaptive: also those that cannot make it
        even dispatched alone now), plus any that ``next_batch`` dropped since the last call."""
        self._expire_due(now)
        out = self._pending_expired
        self._pending_expired = []
        return out

    def _expire_due(self, now: float) -> None:
        for lane in self._order:
            heap = lane.heap
            if not heap:
                continue
            bar = now
            if self._adaptive:
                model = self._model(lane)
                if model is not None:
                    bar = now + model.predict(1)
            top = heap[0][0]
            if top > now and top >= bar:  # nothing due (the top may be stale: harmless)
                continue
            live = lane.live
            dead: dict[int, Record] = {}
            while heap:
                d, _, r = heap[0]
                # hard expiry at deadline <= now; predicted miss when now + latency(1) > deadline
                if d > now and d >= bar:
                    break
                heapq.heappop(heap)
                rid = id(r)
                if rid in live and r.deadline == d:
                    live.discard(rid)
                    dead[rid] = r
            if dead:
                lane.dead.update(dead)
                lane.expired += len(dead)
                self._total -= len(dead)
                lane.n -= len(dead)
                self._pending_expired.extend(dead.values())
                # bound the memory tombstones hold; an all-dead lane is cleared at once (no spurious wake-ups)
                if lane.n == 0 or (len(lane.dead) > 1024 and len(lane.dead) > lane.n):
                    self._purge_dead(lane)

    def _purge_dead(self, lane: _Lane) -> None:
        """Physically drop every tombstoned record of the lane (O(records held); amortised O(1) per
        expired record because it runs only once tombstones outnumber live records)."""
        dead = lane.dead
        if lane.ready_n:
            for b in lane.ready:
                b.records = [r for r in b.records if id(r) not in dead]
            lane.ready = deque(b for b in lane.ready if b.records)
            lane.ready_n = sum(len(b.records) for b in lane.ready)
        if len(lane.batcher):
            lane.batcher.remove(lambda r: id(r) in dead)
        dead.clear()

    # ------------------------------------------------------------------ control
    def revoke(self, tps: set[TopicPartition] | Iterable[TopicPartition]) -> list[Record]:
        """Remove and return the queued (not yet dispatched) records of these partitions, including any
        expired records not yet handed out by ``expire``. O(records queued)."""
        tps = set(tps)
        out: list[Record] = []
        for lane in self._order:
            removed: list[Record] = []
            if lane.ready_n:
                for b in lane.ready:
                    if any(r.tp in tps for r in b.records):
                        removed.extend(r for r in b.records if r.tp in tps)
                        b.records = [r for r in b.records if r.tp not in tps]
                lane.ready = deque(b for b in lane.ready if b.records)
                lane.ready_n = sum(len(b.records) for b in lane.ready)
            if len(lane.batcher):
                removed.extend(lane.batcher.remove(lambda r: r.tp in tps))
            n = 0
            for r in removed:
                rid = id(r)
                if rid in lane.dead:  # expired and already handed out
                    lane.dead.discard(rid)
                    continue
                lane.live.discard(rid)
                out.append(r)
                n += 1
            lane.revoked += n
            lane.n -= n
            self._total -= n
            if lane.n == 0 and lane.dead:  # only tombstones of other partitions left: no spurious wake-ups
                self._purge_dead(lane)
        if self._pending_expired:
            out.extend(r for r in self._pending_expired if r.tp in tps)
            self._pending_expired = [r for r in self._pending_expired if r.tp not in tps]
        return out

    def flush(self, now: float) -> None:
        """Close every open window so ``next_batch`` returns them (shutdown, end of a backfill)."""
        for lane in self._order:
            closed = lane.batcher.flush(now)
            if closed:
                self._push_ready(lane, closed)

    def set_max_batch_size(self, lane: str, n: int) -> None:
        """Change a lane's effective max batch (OOM handling lowers it and raises it back). Queued batches
        larger than the new max are cut at dispatch; open windows split on the next add/poll."""
        if n < 1:
            raise ValueError(f"max batch size must be >= 1, got {n}")
        ln = self._lanes[lane]
        ln.batcher.set_max_batch_size(n)
        ln.max_batch = n
        self._update_lag()

    def max_batch_size(self, lane: str) -> int:
        return self._lanes[lane].max_batch

    def _update_lag(self) -> None:
        self._lag = max(max(ln.cfg_max_batch, ln.max_batch) / ln.weight for ln in self._lanes.values())

    # ------------------------------------------------------------------ introspection
    def next_wakeup(self, now: float) -> float | None:
        """Earliest time the state changes by time alone: a window closes by time, a queued record's
        deadline passes (adaptive: when it can no longer be met), an adaptive hold ends. None when
        nothing is pending. May be <= now (overdue); ready batches are not included."""
        best: float | None = None
        for lane in self._order:
            t = lane.batcher.next_deadline()
            if t is not None and (best is None or t < best):
                best = t
            d = lane.earliest_deadline()
            if d is not None:
                if self._adaptive:
                    model = self._model(lane)
                    if model is not None:
                        d -= model.predict(1)
                if best is None or d < best:
                    best = d
            h = lane.hold_until
            if h is not None and h > now and (best is None or h < best):
                best = h
        return best

    def __len__(self) -> int:
        """Records queued (open windows + ready batches), all lanes."""
        return self._total

    def queued(self, lane: str) -> int:
        return self._lanes[lane].queued()

    def over_bound(self, held: Collection[str] = (), resume_ratio: float = 1.0) -> set[str]:
        """Lanes whose queued count reached their ``queue_bound`` (pause the partitions feeding them), and of the
        lanes ``held`` (the last answer), those still above ``queue_bound * resume_ratio``: without that low
        watermark a lane at its bound paused and resumed its partitions at every loop turn."""
        return {ln.name for ln in self._order
                if ln.queued() >= ln.queue_bound or (ln.name in held and ln.queued() > ln.queue_bound * resume_ratio)}

    def stats(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for ln in self._lanes.values():
            model = self._model(ln)
            out[ln.name] = {
                "queued": ln.queued(),
                "ready_batches": len(ln.ready),
                "open_windows": ln.batcher.open_windows,
                "served_records": ln.served_records,
                "served_batches": ln.served_batches,
                "expired": ln.expired,
                "revoked": ln.revoked,
                "max_batch_size": ln.max_batch,
                "weight": ln.weight,
                "priority": ln.priority,
                "service": ln.vservice,
                "arrival_rate": ln.rate,
                "latency_a_s": model.a if model is not None else None,
                "latency_b_s": model.b if model is not None else None,
            }
        return out


def _take_live(recs: list[Record], out: list[Record], m: int, dead: set[int]) -> int:
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
