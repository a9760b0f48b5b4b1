"""How long a lane's open window waits and which queued records are past saving: one class per policy.

Both policies fit, per lane, an online least-squares model ``latency(n) = a + b*n`` of the device
(``LatencyModel``, fed by ``observe``; a pooled model stands in for lanes without enough observations):
``fitted`` reports it, whatever the policy (the scheduler's fill size for ``fill_efficiency`` reads it under
both). ``planning`` is the model the waiting and deadline decisions use: None under "fixed", so those
branches of the scheduler are off.

Policy "fixed"
--------------
Windows close by count or ``max_wait``; an idle device takes the best open window at once.

Policy "adaptive" (the latency predictor and adaptive timeout of design seed 000)
--------------------------------------------------------------------------------
Per lane an arrival-rate estimate ``lam`` (records/s, exponentially smoothed) besides the latency model.

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
- *Fill*: a batch filled with lower lanes' records (``fill_with_lower``) stops where its earliest deadline
  would be missed (``fill_room``), and a lower lane whose earliest deadline the filled batch would miss is
  skipped, so no record is expired on a filled batch's account.

Until a model has ``min_obs`` observations, "adaptive" behaves exactly like "fixed".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

from worker.core.lane import Lane
from worker.core.latency import LatencyModel
from worker.core.records import Batch, Record

Policy = Literal["fixed", "adaptive"]

MIN_HOLD_S = 1e-4  # an adaptive wait shorter than this is not worth a wake-up


class QueuePolicy:
    """The policy "fixed" (and what every policy shares: the fitted latency models)."""

    name: str = "fixed"
    window_reason = "idle"  # the reason an idle device's early-closed window carries

    def __init__(self) -> None:
        self.pooled = LatencyModel()  # every lane's batches: stands in for a lane with too few of its own

    def observe(self, lane: Lane | None, n: int, seconds: float) -> None:
        if lane is not None:
            lane.model.observe(n, seconds)
        self.pooled.observe(n, seconds)

    def fitted(self, lane: Lane) -> LatencyModel | None:
        """The lane's latency model once it is fitted, else the pooled one once that is; else None."""
        if lane.model.ready:
            return lane.model
        if self.pooled.ready:
            return self.pooled
        return None

    def predict(self, lane: Lane, n: int) -> float:
        model = self.fitted(lane)
        return model.predict(n) if model is not None else 0.0

    def planning(self, lane: Lane) -> LatencyModel | None:
        """The model the scheduler's decisions use for ``lane``; None: decide without one."""
        return None

    def expiry_bar(self, lane: Lane, now: float) -> float:
        """A queued record whose deadline is below this is expired now."""
        return now

    def wakeup_at(self, lane: Lane, deadline: float) -> float:
        """When the state of a record with this deadline changes by time alone."""
        return deadline

    def begin_round(self, lane: Lane, now: float, idle: bool) -> None:
        """A dispatch decision starts (``idle``: for a device with nothing else to do)."""

    def hold_until(self, lane: Lane, now: float, order: Sequence[Lane]) -> float | None:
        """When to dispatch the lane's oldest open window if waiting for more records pays, else None."""
        return None

    def misses(self, lane: Lane, recs: list[Record], now: float, ahead: int = 0) -> list[Record]:
        """The records of a batch leaving now that would miss their deadline in it (``ahead``: records the
        device runs with them); the caller expires them."""
        return []


class FixedPolicy(QueuePolicy):
    """Windows close by count or ``max_wait``; an idle device takes the best open window at once."""


class AdaptivePolicy(QueuePolicy):
    """Waits when waiting raises throughput, expires what cannot make its deadline (module docstring)."""

    name = "adaptive"
    window_reason = "adaptive"

    def planning(self, lane: Lane) -> LatencyModel | None:
        return self.fitted(lane)

    def expiry_bar(self, lane: Lane, now: float) -> float:
        # A hard expiry at deadline <= now; a predicted miss when now + latency(1) > deadline.
        model = self.fitted(lane)
        return now + model.predict(1) if model is not None else now

    def wakeup_at(self, lane: Lane, deadline: float) -> float:
        model = self.fitted(lane)
        return deadline - model.predict(1) if model is not None else deadline

    def begin_round(self, lane: Lane, now: float, idle: bool) -> None:
        lane.update_rate(now)
        if idle:
            lane.hold_until = None

    def hold_until(self, lane: Lane, now: float, order: Sequence[Lane]) -> float | None:
        model = self.fitted(lane)
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
        for other in order:
            d = other.earliest_deadline()
            if d is None:
                continue
            extra = 0.0 if other is lane else self.predict(other, min(other.queued(), other.max_batch))
            t = min(t, (d - now - a - b * k - extra) / denom)
        if t < MIN_HOLD_S:
            return None
        return now + t

    def misses(self, lane: Lane, recs: list[Record], now: float, ahead: int = 0) -> list[Record]:
        if not lane.live:
            return []
        model = self.fitted(lane)
        if model is None:
            return []
        a, b = model.a, model.b
        a += b * ahead  # the records already in the batch lengthen it as much as these do
        n = len(recs)
        earliest = min((r.deadline for r in recs if r.deadline is not None), default=None)
        if earliest is None or earliest >= now + a + b * n:
            return []
        # Largest kept set such that every kept deadline >= now + a + b * kept: records without deadline
        # always stay; then the latest deadlines first (kept deadlines fall while the bar rises, so the
        # first failure ends the search).
        timed = sorted((r for r in recs if r.deadline is not None), key=lambda r: r.deadline or 0.0,
                       reverse=True)
        k = n - len(timed)
        keep_ids: set[int] = set()
        for r in timed:
            assert r.deadline is not None
            if r.deadline >= now + a + b * (k + 1):
                k += 1
                keep_ids.add(id(r))
            else:
                break
        return [r for r in recs if r.deadline is not None and id(r) not in keep_ids]


POLICIES: dict[str, type[QueuePolicy]] = {"fixed": FixedPolicy, "adaptive": AdaptivePolicy}


def make_policy(name: str) -> QueuePolicy:
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"policy must be one of {', '.join(repr(p) for p in POLICIES)}, got {name!r}")
    return cls()


def fill_room(model: LatencyModel, batch: Batch, now: float, room: int) -> int:
    """At most ``room`` records, and no more than fit before the batch's earliest deadline."""
    earliest = min((r.deadline for r in batch.records if r.deadline is not None), default=None)
    if earliest is None or model.b <= 0 or not math.isfinite(earliest):
        return room
    return min(room, math.floor((earliest - now - model.a) / model.b) - len(batch.records))
