"""The records queued per lane, and the accounting of every record that enters or leaves them.

``LaneQueues`` keeps one ``Lane`` (open windows + ready FIFO) per configured lane, the total count, the
records expired but not yet handed out, and each lane's fair-share service counter ``vservice``: the
records it was served divided by its ``weight``. ``PriorityScheduler`` (``worker.core.scheduler``) adds
the dispatch decisions on top.

Deadlines
---------
A record whose ``deadline`` is ``<= now`` is expired: ``add`` hands it straight back, ``expire(now)``
returns queued ones (``Lane.expire_due``: O(log n) per record), and every dispatch expires first, so no
expired record is ever returned in a batch. Records expired by a dispatch itself are handed out by the
next ``expire`` call. The policy may expire earlier (``QueuePolicy.expiry_bar`` and ``misses``: records
that cannot make their deadline any more).

Pure: ``now`` is passed in (monotonic seconds, non-decreasing); no clocks, threads or I/O. Not
thread-safe: the runner serializes calls. Costs: ``add`` O(1) (+ O(log n) with a deadline), expiry
O(log n) amortised per record, ``revoke`` O(records queued).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence
from typing import Any

from worker.core.lane import Lane
from worker.core.lane_settings import LaneSettings, LaneSpec
from worker.core.queue_policy import Policy, make_policy
from worker.core.records import Batch, Record, TopicPartition


class LaneQueues:
    def __init__(self, lanes: Sequence[LaneSpec], default_lane: str, policy: Policy | str = "fixed",
                 bucket_width: int = 0) -> None:
        if not lanes:
            raise ValueError("at least one lane is required")
        settings = [LaneSettings.of(lane) for lane in lanes]
        names = [lane.name for lane in settings]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"duplicate lane names: {dupes}")
        if default_lane not in names:
            raise ValueError(f"default_lane {default_lane!r} is not one of the lanes {names}")
        self._policy = make_policy(policy)
        self.policy = self._policy.name
        self.default_lane = default_lane
        self._lanes: dict[str, Lane] = {c.name: Lane(c, i, bucket_width) for i, c in enumerate(settings)}
        # Preference order: higher priority first, ties by config order.
        self._order: list[Lane] = sorted(self._lanes.values(), key=lambda ln: (-ln.priority, ln.index))
        self._pending_expired: list[Record] = []
        self._total = 0
        # A record with a deadline was ever queued (else drop_expired has nothing to look for).
        self._deadlines_seen = False
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
            lane.purge_dead()
        if lane.n == 0 and not lane.ahead:
            # (A lane whose records are all in a batch taken ahead is still backlogged: raising its service to
            # the others' would wipe out the lag that made its batch owed, and a preempted batch would then
            # be preempted again at every start until it is full.)
            self._becomes_backlogged(lane, now)
        closed = lane.batcher.add(record, now)
        if closed:
            lane.push_ready(closed)
        if d is not None:
            self._deadlines_seen = True
            lane.track_deadline(record, d)
        lane.n += 1
        self._total += 1
        lane.arrivals += 1
        return []

    def _becomes_backlogged(self, lane: Lane, now: float) -> None:
        """A lane that becomes backlogged starts at ``max(v_i, v_min of the backlogged lanes)``: idle time
        earns no credit to burst with later."""
        if lane.rate_t is None:
            lane.rate_t = now
        if self._total == 0:
            for ln in self._order:  # nobody backlogged: start a fresh fairness epoch
                ln.vservice = 0.0
            return
        others = [ln.vservice for ln in self._order if ln is not lane and ln.n]
        if others:
            lane.vservice = max(lane.vservice, min(others))

    # ------------------------------------------------------------------ leaving the queue
    def _finalize(self, batch: Batch, now: float, ahead: int = 0) -> Batch | None:
        """Account for a batch leaving the queue; the policy expires records predicted to miss their deadline
        (``ahead``: records the device runs with them, a batch being filled). Returns None when nothing is
        left to send."""
        lane = self._lanes[batch.lane]
        recs = batch.records = lane.drop_tombstones(batch.records)  # tombstones in a window taken early
        missed = self._policy.misses(lane, recs, now, ahead)
        if missed:
            gone = {id(r) for r in missed}
            recs = batch.records = [r for r in recs if id(r) not in gone]
            for r in missed:
                lane.live.discard(id(r))
            lane.expired += len(missed)
            lane.n -= len(missed)
            self._total -= len(missed)
            self._pending_expired.extend(missed)
        n = len(recs)
        self._total -= n
        lane.n -= n
        if lane.n == 0 and lane.dead:
            # Tombstones left in an open window with nothing live behind them would keep its close time in
            # next_wakeup, overdue for good: the device's wait would turn into a busy loop on the lock.
            lane.purge_dead()
        live = lane.live
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

    def _requeue(self, lane: Lane, batch: Batch) -> None:
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
                self._deadlines_seen = True
                lane.track_deadline(r, r.deadline)

    def observe(self, lane: str, n: int, seconds: float) -> None:
        """Feed the latency model with a finished batch: ``n`` records took ``seconds`` on the device."""
        self._policy.observe(self._lanes.get(lane), n, seconds)

    # ------------------------------------------------------------------ expiry
    def expire(self, now: float) -> list[Record]:
        """Remove and return queued records past their deadline (adaptive: also those that cannot make it
        even dispatched alone now), plus any that ``next_batch`` dropped since the last call."""
        self._expire_due(now)
        out = self._pending_expired
        self._pending_expired = []
        return out

    def _expire_due(self, now: float) -> None:
        policy = self._policy
        for lane in self._order:
            if not lane.heap:
                continue
            dead = lane.expire_due(now, policy.expiry_bar(lane, now))
            if dead:
                self._total -= len(dead)
                self._pending_expired.extend(dead)

    # ------------------------------------------------------------------ control
    def revoke(self, tps: set[TopicPartition] | Iterable[TopicPartition]) -> list[Record]:
        """Remove and return the queued (not yet dispatched) records of these partitions, including any
        expired records not yet handed out by ``expire``. O(records queued)."""
        tps = set(tps)
        out: list[Record] = []
        for lane in self._order:
            removed = lane.revoke(lambda r: r.tp in tps)
            self._total -= len(removed)
            out.extend(removed)
        if self._pending_expired:
            out.extend(r for r in self._pending_expired if r.tp in tps)
            self._pending_expired = [r for r in self._pending_expired if r.tp not in tps]
        return out

    def flush(self, now: float) -> None:
        """Close every open window so ``next_batch`` returns them (shutdown, end of a backfill)."""
        for lane in self._order:
            closed = lane.batcher.flush(now)
            if closed:
                lane.push_ready(closed)

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

    def set_max_batch_tokens(self, lane: str, tokens: int | None) -> None:
        """Change a lane's effective token budget (None: none; OOM handling lowers it and puts the
        configured one back). Queued batches over the new budget are cut at dispatch; open windows split
        on the next add/poll."""
        if tokens is not None and tokens < 1:
            raise ValueError(f"max batch tokens must be >= 1 (or None: no budget), got {tokens}")
        ln = self._lanes[lane]
        ln.batcher.set_max_batch_tokens(tokens)
        ln.max_tokens = tokens

    def max_batch_tokens(self, lane: str) -> int | None:
        return self._lanes[lane].max_tokens

    def _update_lag(self) -> None:
        """``L = max_j(max_batch_size_j / weight_j)``: one batch of lag, in normalized units."""
        self._lag = max(max(ln.cfg_max_batch, ln.max_batch) / ln.weight for ln in self._lanes.values())

    # ------------------------------------------------------------------ introspection
    def next_wakeup(self, now: float) -> float | None:
        """Earliest time the state changes by time alone: a window closes by time, a queued record's
        deadline passes (adaptive: when it can no longer be met), an adaptive hold ends. None when
        nothing is pending. May be <= now (overdue); ready batches are not included."""
        best: float | None = None
        policy = self._policy
        for lane in self._order:
            t = lane.batcher.next_deadline()
            if t is not None and (best is None or t < best):
                best = t
            d = lane.earliest_deadline()
            if d is not None:
                d = policy.wakeup_at(lane, d)
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
        """Lanes whose queued count reached their ``queue_bound`` (pause the partitions feeding them), and of
        the lanes ``held`` (the last answer), those still above ``queue_bound * resume_ratio``: the low
        watermark keeps a lane at its bound from pausing and resuming its partitions at every loop turn."""
        return {ln.name for ln in self._order
                if ln.queued() >= ln.queue_bound
                or (ln.name in held and ln.queued() > ln.queue_bound * resume_ratio)}

    def stats(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for ln in self._lanes.values():
            model = self._policy.fitted(ln)
            out[ln.name] = {
                "queued": ln.queued(),
                "ready_batches": len(ln.ready),
                "open_windows": ln.batcher.open_windows,
                "served_records": ln.served_records,
                "served_batches": ln.served_batches,
                "expired": ln.expired,
                "revoked": ln.revoked,
                "max_batch_size": ln.max_batch,
                "max_batch_tokens": ln.max_tokens,
                "weight": ln.weight,
                "priority": ln.priority,
                "service": ln.vservice,
                "arrival_rate": ln.rate,
                "latency_a_s": model.a if model is not None else None,
                "latency_b_s": model.b if model is not None else None,
            }
        return out
