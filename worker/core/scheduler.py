"""Which lane's batch a free device runs next: priorities, weighted fair shares, deadlines, adaptive waits.

Lanes (e.g. ``interactive`` and ``bulk``) share the devices. Interactive work goes first, bulk work never
starves, records past their deadline never reach the model, and an idle device does not sit waiting for a
window to fill when waiting cannot pay off.

Structure: one ``Lane`` per configured lane (``worker.core.lane``: open windows plus a FIFO of closed
batches), kept and accounted for by ``LaneQueues`` (``worker.core.lane_queues``: intake, expiry,
revocation); the queue policy (``worker.core.queue_policy``, "fixed" or "adaptive") decides how long an
open window waits and which records are past saving. The runner ``add``s records, and each time a device
is free it asks ``next_batch(now, idle=...)``.

Choosing a lane (both policies)
-------------------------------
Each lane ``i`` keeps a normalized service counter ``v_i``: the records it was served divided by its
``weight``. *Candidates* are the lanes with dispatchable work: a ready batch, or (``idle=True`` only) an
open window. A candidate is *eligible* when ``v_i < v_min + L``, where ``v_min`` is the smallest ``v``
among candidates and ``L = max_j(max_batch_size_j / weight_j)`` (one batch of lag, in normalized units).
The eligible lane with the highest ``priority`` is served (ties: the lane listed first in the config); it
gets its oldest ready batch, or, if it has none and the device is idle, its oldest open window
(work-conserving: an idle device never waits out ``max_wait`` when there is work). A lane that becomes
backlogged starts at ``v_i = max(v_i, v_min of the backlogged lanes)``: idle time earns no credit to burst
with later.

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
lane has the option and that holds fewer than its fill size takes the oldest live records of lower-priority
lanes into the free slots: higher priority first, each lane's ready batches and then its open windows. The
fill size is ``max_batch_size``, or with ``fill_efficiency`` < 1 and a fitted latency model the smallest size
whose throughput reaches that fraction of a full batch's (``worker.core.latency.efficient_size``): under
overload every batch carries high-lane records, and the last few records of a full batch add little
throughput but their whole ``b*n`` to the time a high-lane record waits for the batch ahead and its own.
In ``preempt`` the displaced batch's front records go first (they are the oldest of their lane, already
accounted for; the rest is requeued). Each added record keeps its lane and is charged to its lane's
service counter, so the fairness bound above holds per lane; the batch is marked ``mixed``. A high lane
whose windows close by time under overload thus runs near-full batches instead of batches of a few
records whose fixed cost takes most of the device. A batch taken ahead is full, or is a lane's partial
batch owed the device: that one is topped up from its own lane and then filled when its device starts it
(``top_up``). With size buckets the option is off. With a token budget (lane option ``max_batch_tokens``)
the free room is counted in tokens too: a record that does not fit stops the filling from its lane.

Taken ahead: a batch taken while its device is still busy (``next_batch(idle=False)``) can age before the
device starts it; at the start the runner calls ``start``, ``drop_expired`` (its records past their
deadline by then), ``preempt`` (a higher lane's closed batch goes first) and else ``top_up``.

Costs: ``next_batch`` O(lanes + batch size); the rest as in ``worker.core.lane_queues``.
"""

from __future__ import annotations

from worker.core.batcher import cost, fitting
from worker.core.lane import Lane
from worker.core.lane_queues import LaneQueues
from worker.core.latency import efficient_size
from worker.core.queue_policy import Policy, fill_room
from worker.core.records import Batch, Record

__all__ = ["Policy", "PriorityScheduler"]


class PriorityScheduler(LaneQueues):
    """The dispatch decisions over ``LaneQueues`` (see the module docstring)."""

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
        policy = self._policy
        for lane in self._order:
            lane.close_due_windows(now)
            policy.begin_round(lane, now, idle)
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
        room = self._fill_size(lane) - len(batch.records)
        troom = lane.token_room(batch.records)  # (token budget: what is left of it, else None)
        if not lane.fill or room <= 0 or (troom is not None and troom <= 0):
            return batch
        model = self._policy.planning(lane)
        if model is not None:
            room = fill_room(model, batch, now, room)
            if room <= 0:
                return batch
        added: list[Record] = []
        if donor is not None and self._lanes[donor.lane].priority < lane.priority:
            take = donor.records[:fitting(donor.records, room, troom, lone=False)]
            # (adaptive: not if one of them would miss its deadline in the filled batch; they stay in theirs)
            end = now + model.predict(len(batch.records) + len(take)) if model is not None else None
            if end is None or all(r.deadline is None or r.deadline >= end for r in take):
                del donor.records[:len(take)]
                added.extend(take)
                room -= len(take)
                troom = None if troom is None else troom - sum(cost(r) for r in take)
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
                    own = self._policy.fitted(other)
                    end = now + max(model.predict(n_all), own.predict(n_all) if own is not None else 0.0)
                    if d < end:
                        continue
            while room > 0 and other.n and (troom is None or troom > 0):
                got = other.take_fill(now, room, troom)
                if got is None:
                    break
                part = self._finalize(got, now, ahead=len(batch.records) + len(added))
                if part is not None:
                    added.extend(part.records)
                    room -= len(part.records)
                    troom = None if troom is None else troom - sum(cost(r) for r in part.records)
        if added:
            batch.records.extend(added)
            batch.mixed = True
        return batch

    def _fill_size(self, lane: Lane) -> int:
        """How many records a filled batch of ``lane`` holds at most: ``max_batch_size``, or with
        ``fill_efficiency`` < 1 and a fitted latency model (either policy) the smallest size that reaches
        that fraction of a full batch's throughput (``efficient_size``)."""
        if lane.fill_efficiency >= 1.0:
            return lane.max_batch
        model = self._policy.fitted(lane)
        if model is None:
            return lane.max_batch
        return efficient_size(model, lane.max_batch, lane.fill_efficiency)

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
        policy = self._policy
        hold = policy.hold_until(lane, now, self._order)
        if hold is None:
            return lane.batcher.take_open(now, lane.max_batch, policy.window_reason)
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
            if now + policy.predict(other, n) <= hold:
                if other.ready_n:
                    return other.pop_ready()
                return other.batcher.take_open(now, other.max_batch, policy.window_reason)
        return None

    def _select_ahead(self) -> Lane | None:
        """The lane whose batch is taken ahead (the device is still busy), or None.

        Full batches are taken ahead; a partial one normally is not: taken now, it would leave behind every
        record of its lane arriving while the device is busy (a higher-priority partial batch goes through
        ``preempt`` when the device is about to start). But the fair-share rule still counts the lanes
        with partial batches: under overload the device never becomes idle, so a lane whose windows close by
        time with a few records would otherwise never run while other lanes keep filling batches. When no
        lane with a full batch is within one batch of lag of the least-served lane with ready work, that
        lane's partial batch is owed the device and goes now."""
        cands = [ln for ln in self._order if ln.ready_n]
        full = [ln for ln in cands if ln.ready_full()]
        if not full:
            return None  # the device takes a partial batch when it is free (work-conserving)
        limit = self._lag_limit(cands)
        owed = next((ln for ln in full if ln.vservice < limit), None)
        return owed if owed is not None else self._eligible(cands)

    def _lag_limit(self, cands: list[Lane]) -> float:
        """A candidate is eligible while its normalized service is below this: one batch of lag."""
        return min(ln.vservice for ln in cands) + self._lag

    def _eligible(self, cands: list[Lane]) -> Lane:
        """The lane to serve among the candidates (in priority order): the first within one batch of lag
        of the least-served one (see "Choosing a lane")."""
        limit = self._lag_limit(cands)
        lane = next((ln for ln in cands if ln.vservice < limit), None)
        if lane is None:  # only reachable through float rounding on huge counters
            lane = min(cands, key=lambda ln: ln.vservice)
        return lane

    def start(self, batch: Batch) -> bool:
        """The device is about to start ``batch`` (before ``drop_expired``, ``preempt`` and ``top_up``): a
        batch taken ahead no longer counts as its lane's waiting work. Called for every batch; a no-op for
        others. Returns whether ``batch`` was taken ahead (only such a batch is topped up at its start: one a
        free device took was topped up and filled then)."""
        if not batch.ahead:
            return False
        batch.ahead = False
        lane = self._lanes.get(batch.lane)
        if lane is not None and lane.ahead > 0:
            lane.ahead -= 1
        return True

    def preempt(self, batch: Batch, now: float) -> Batch | None:
        """A device is about to start ``batch``, which it took earlier (prefetched while it was busy). If a
        lane of higher priority than ``batch``'s has a closed batch (its window closed by count or
        ``max_wait``) and is the lane ``next_batch(now, idle=True)`` would serve first, that lane's batch is
        returned (topped up from its open window) and ``batch`` goes back to the front of its lane as if it
        had never been taken (counts, fair-share service, deadlines). Else None: run ``batch``.

        A prefetched batch is taken up to one batch-time before the device can start it; under overload
        that is always a full low-priority batch, so without this a high-priority record would wait for two
        low batches (the running one and the prefetched one) instead of one. A window still open is not
        taken early: it goes after ``batch`` with the records that arrive meanwhile, which keeps
        high-priority batches from shrinking to a record or two and eating the device's time in fixed costs
        under overload."""
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
                ln.close_due_windows(now)
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

        Such a batch was taken up to a batch-time before its device could start it: its lane's records
        arriving meanwhile go with it instead of waiting for a batch of their own, and a fill lane's free
        slots do not stay empty."""
        lane = self._lanes.get(batch.lane)
        if lane is None or lane.batcher.bucket_width or not batch.records:
            return None
        room = lane.max_batch - len(batch.records)
        if room <= 0 or not (lane.n or (lane.fill and self._total)):
            return None
        self._expire_due(now)
        out = batch.with_records(list(batch.records))
        model = self._policy.planning(lane)
        if model is not None:
            room = fill_room(model, out, now, room)
        troom = lane.token_room(out.records)
        if room > 0 and lane.n and (troom is None or troom > 0):
            own = self._select_from(lane, now, True, room, troom)
            part = self._finalize(own, now, ahead=len(out.records))
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

    def _select_from(self, lane: Lane, now: float, idle: bool, limit: int | None = None,
                     tokens: int | None = None) -> Batch:
        """The lane's next ready batch of at most ``limit`` records (default ``max_batch_size``) and
        ``tokens`` cost (the room left in a batch being topped up); it has a ready batch, or, with
        ``idle``, an open window."""
        m = lane.max_batch if limit is None else limit
        if idle and lane.ready_n < m and len(lane.batcher):
            # Work-conserving top-up: a partial batch (closed by time while the device was busy) takes
            # along the records that arrived since, instead of leaving them for the next round.
            extra = lane.batcher.take_open(now, m - lane.ready_n, "idle")
            if extra is not None:
                lane.push_ready([extra])
        return lane.pop_ready(limit, tokens)
