from __future__ import annotations

import itertools

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.support.props import examples
from tests.unit import fakes
from tests.unit.batching_ops import LANES, PRIORITY, SchedulerPlay
from tests.unit.fakes import FakeClock, ids, rec, recs
from worker.config.settings import LaneConfig
from worker.core import lane as lane_module
from worker.core.records import Batch, Record, TopicPartition
from worker.core.scheduler import PriorityScheduler


def lanes(*specs: dict[str, object]) -> list[LaneConfig]:
    """Lanes as configured, but filling only where a test says so: most tests here pin how lanes behave
    apart (``fill_with_lower`` is on by default; ``test_scheduler_fill_limit.py`` covers the default)."""
    return fakes.lanes(*({"fill_with_lower": False} | spec for spec in specs))


def two_lanes(policy: str = "fixed", hi_weight: float = 1.0, lo_weight: float = 1.0, batch: int = 4,
              wait_ms: float = 10.0, lo_first: bool = False, **kw: object) -> PriorityScheduler:
    """``lo_first`` lists the low lane before the high one: priority, not config order, must decide."""
    hi = {"name": "hi", "priority": 10, "weight": hi_weight, "max_batch_size": batch, "max_wait_ms": wait_ms}
    lo = {"name": "lo", "priority": 0, "weight": lo_weight, "max_batch_size": batch, "max_wait_ms": wait_ms}
    cfg = lanes(*((lo, hi) if lo_first else (hi, lo)), {"name": "default", "max_batch_size": batch,
                                                       "max_wait_ms": wait_ms})
    return PriorityScheduler(cfg, "default", policy, **kw)  # type: ignore[arg-type]


def feed(s: PriorityScheduler, rs: list[Record], now: float) -> list[Record]:
    late: list[Record] = []
    for r in rs:
        late += s.add(r, now)
    return late


def drain(s: PriorityScheduler, now: float, idle: bool = True) -> list[Batch]:
    out = []
    while (b := s.next_batch(now, idle)) is not None:
        out.append(b)
    return out


# ---------------------------------------------------------------- routing

TOPICS = {"fast-in": "hi", "bulk-in": "lo", "stale-in": "gone"}


@pytest.mark.parametrize(("topic", "header", "field", "expect"), [
    ("bulk-in", "hi", "lo", ("hi", False)),  # header wins
    ("bulk-in", None, "hi", ("hi", False)),  # then the request field
    ("fast-in", None, None, ("hi", False)),  # then the topic's lane
    ("bulk-in", "", " ", ("lo", False)),  # blank values count as absent
    ("other", None, None, ("default", False)),  # unmapped topic: default lane
    ("bulk-in", "urgent", "hi", ("default", True)),  # unknown name: default lane, flagged
    ("fast-in", None, "nope", ("default", True)),
    ("stale-in", None, None, ("default", True)),  # topic mapped to a lane that does not exist
    ("bulk-in", " hi ", None, ("hi", False)),
])
def test_lane_for(topic: str, header: str | None, field: str | None, expect: tuple[str, bool]) -> None:
    assert two_lanes().lane_for(topic, header, field, TOPICS) == expect


def test_rejects_bad_setup() -> None:
    cfg = lanes({"name": "a"}, {"name": "b"})
    with pytest.raises(ValueError, match="default_lane"):
        PriorityScheduler(cfg, "zzz")
    with pytest.raises(ValueError, match="policy"):
        PriorityScheduler(cfg, "a", "greedy")
    with pytest.raises(ValueError, match="duplicate"):
        PriorityScheduler(lanes({"name": "a"}, {"name": "a"}), "a")
    with pytest.raises(ValueError, match="at least one"):
        PriorityScheduler([], "a")


def test_unknown_record_lane_goes_to_default() -> None:
    s = two_lanes()
    r = rec("nope")
    s.add(r, 0.0)
    assert r.lane == "default" and s.queued("default") == 1


# ---------------------------------------------------------------- closing and work conservation


def test_idle_device_gets_an_open_window_at_once() -> None:
    s = two_lanes(batch=8)
    r = rec("lo")
    s.add(r, 1.0)
    b = s.next_batch(1.0, idle=True)
    assert b is not None and b.records == [r] and b.reason == "idle" and b.lane == "lo"
    assert len(s) == 0 and s.next_batch(1.0) is None


def test_busy_device_lets_windows_fill() -> None:
    s = two_lanes(batch=4, wait_ms=10)
    rs = recs(3, "lo")
    feed(s, rs, 1.0)
    assert s.next_batch(1.0, idle=False) is None
    assert s.next_wakeup(1.0) == pytest.approx(1.010)
    late = rec("lo")
    s.add(late, 1.005)
    b = s.next_batch(1.005, idle=False)
    assert b is not None and b.reason == "count" and b.records == [*rs, late]
    s.add(rec("lo"), 1.006)
    assert s.next_batch(1.015, idle=False) is None
    b = s.next_batch(1.016, idle=False)
    assert b is not None and b.reason == "time" and len(b) == 1


def test_flush_closes_all_windows() -> None:
    s = two_lanes(batch=8)
    feed(s, recs(3, "lo") + recs(2, "hi"), 0.0)
    s.flush(0.0)
    out = drain(s, 0.0, idle=False)
    assert [(b.lane, len(b), b.reason) for b in out] == [("hi", 2, "flush"), ("lo", 3, "flush")]


def test_batches_never_mix_lanes_and_keep_arrival_order() -> None:
    s = two_lanes(batch=3)
    rs = [rec("hi" if i % 2 else "lo") for i in range(12)]
    feed(s, rs, 0.0)
    out = drain(s, 0.0)
    for b in out:
        assert {r.lane for r in b.records} == {b.lane}
    for lane in ("hi", "lo"):
        got = [r.id for b in out if b.lane == lane for r in b.records]
        assert got == [r.id for r in rs if r.lane == lane]


# ---------------------------------------------------------------- priorities and fairness


@pytest.mark.parametrize("lo_first", [False, True], ids=["hi-listed-first", "lo-listed-first"])
def test_high_lane_served_first_when_both_backlogged(lo_first: bool) -> None:
    s = two_lanes(batch=4, lo_first=lo_first)
    feed(s, recs(8, "lo"), 0.0)  # the low lane was there first
    feed(s, recs(8, "hi"), 0.001)
    out = drain(s, 0.001)
    assert [b.lane for b in out] == ["hi", "lo", "hi", "lo"]  # equal weights: then they alternate


@pytest.mark.parametrize("lo_first", [False, True], ids=["hi-listed-first", "lo-listed-first"])
def test_higher_weight_gets_proportionally_more(lo_first: bool) -> None:
    s = two_lanes(hi_weight=3.0, lo_weight=1.0, batch=4, lo_first=lo_first)
    feed(s, recs(400, "lo") + recs(400, "hi"), 0.0)
    first = [b.lane for b in (s.next_batch(0.0) for _ in range(40)) if b is not None]
    assert first[0] == "hi"
    assert first.count("hi") == 30 and first.count("lo") == 10


@pytest.mark.parametrize(("w_hi", "w_lo", "b_hi", "b_lo"), [(1, 1, 8, 8), (9, 1, 8, 8), (1, 4, 16, 4),
                                                            (5, 2, 3, 32)])
def test_low_lane_keeps_its_weighted_share_under_sustained_overload(w_hi: float, w_lo: float, b_hi: int,
                                                                      b_lo: int) -> None:
    cfg = lanes({"name": "hi", "priority": 10, "weight": w_hi, "max_batch_size": b_hi},
                {"name": "lo", "priority": 0, "weight": w_lo, "max_batch_size": b_lo})
    s = PriorityScheduler(cfg, "lo")
    clock = FakeClock()
    served = {"hi": 0, "lo": 0}
    lag = max(b_hi / w_hi, b_lo / w_lo)
    weights = {"hi": w_hi, "lo": w_lo}
    for _ in range(2000):
        for lane, b in (("hi", b_hi), ("lo", b_lo)):  # arrivals beyond capacity: both stay backlogged
            while s.queued(lane) < 3 * b:
                s.add(rec(lane), clock.now())
        batch = s.next_batch(clock.now())
        assert batch is not None
        served[batch.lane] += len(batch)
        clock.advance(0.001)
        total = sum(served.values())
        for lane, w in weights.items():  # the documented bound holds at every step
            assert served[lane] >= total * w / (w_hi + w_lo) - 4 * lag * w
    share = served["lo"] / sum(served.values())
    assert share >= w_lo / (w_hi + w_lo) - 0.01


def test_idle_lane_earns_no_credit() -> None:
    s = two_lanes(batch=4)
    feed(s, recs(40, "hi"), 0.0)
    drain(s, 0.0)  # hi served alone for a while
    feed(s, recs(8, "lo"), 1.0)
    feed(s, recs(8, "hi"), 1.0)
    # lo arrives with hi's service level, not zero: hi still goes first instead of lo getting a burst
    assert [b.lane for b in drain(s, 1.0)] == ["hi", "lo", "hi", "lo"]


def test_stats_count_served_records_and_batches() -> None:
    s = two_lanes(batch=2)
    feed(s, recs(4, "hi") + recs(4, "lo"), 0.0)
    assert [b.lane for b in drain(s, 0.0)] == ["hi", "lo", "hi", "lo"]
    st_ = s.stats()
    assert st_["hi"]["served_records"] == 4 and st_["lo"]["served_batches"] == 2


# ---------------------------------------------------------------- deadlines


def test_record_already_late_is_returned_by_add() -> None:
    s = two_lanes()
    r = rec("hi", deadline=5.0)
    assert s.add(r, 5.0) == [r]
    assert len(s) == 0


def test_expired_records_are_never_dispatched() -> None:
    s = two_lanes(batch=4)
    soon = [rec("lo", deadline=1.5) for _ in range(3)]
    later = [rec("lo", deadline=9.0), rec("lo")]
    feed(s, soon + later, 1.0)  # one full batch [soon x3, later0] + one open window
    assert s.next_wakeup(1.0) == pytest.approx(1.010)
    b = s.next_batch(2.0, idle=True)
    # the expired records are dropped and the batch is topped up from the (now time-closed) window
    assert b is not None and b.records == later
    assert ids(s.expire(2.0)) == ids(soon)
    assert s.next_batch(2.0) is None and s.expire(2.0) == [] and len(s) == 0


def test_expiry_under_overload_still_runs_full_batches() -> None:
    s = two_lanes(batch=4, wait_ms=1000)
    rs = [rec("lo", deadline=1.5 if i % 3 == 0 else 9.0) for i in range(24)]  # a third will expire
    feed(s, rs, 1.0)
    out = drain(s, 2.0, idle=False)
    assert [len(b) for b in out] == [4, 4, 4, 4]
    assert ids(r for b in out for r in b.records) == ids(r for r in rs if r.deadline == 9.0)
    assert len(s.expire(2.0)) == 8


def test_expire_without_dispatch_and_wakeup_at_deadline() -> None:
    s = two_lanes(batch=100, wait_ms=60_000)
    a, b = rec("hi", deadline=2.0), rec("lo", deadline=3.0)
    feed(s, [a, b], 1.0)
    assert s.next_wakeup(1.0) == 2.0
    assert s.expire(1.999) == []
    assert s.expire(2.0) == [a]
    assert s.next_wakeup(2.0) == 3.0
    assert s.expire(10.0) == [b] and len(s) == 0 and s.next_wakeup(10.0) is None


def test_deadline_heap_stays_bounded_after_dispatch() -> None:
    s = two_lanes(batch=4)
    for i in range(5000):
        s.add(rec("hi", deadline=1e9), float(i))
        if i % 4 == 3:
            assert s.next_batch(float(i)) is not None
    lane = s._lanes["hi"]
    assert len(lane.live) == 0 and len(lane.heap) <= 64 + 4


# ---------------------------------------------------------------- revoke, bounds, OOM


def test_revoke_removes_queued_records_of_those_partitions() -> None:
    s = two_lanes(batch=2)
    p0 = [rec("lo", partition=0) for _ in range(3)]
    p1 = [rec("lo", partition=1) for _ in range(3)]
    expired = rec("hi", partition=1, deadline=0.5)
    feed(s, [x for pair in zip(p0, p1, strict=True) for x in pair] + [expired], 0.0)
    s.next_batch(1.0)  # expires `expired` internally (handed out by expire() later) and serves a batch
    gone = s.revoke({TopicPartition("in", 1)})
    assert {r.id for r in gone} == {r.id for r in p1[1:]} | {expired.id}
    assert s.expire(1.0) == []
    rest = [r for b in drain(s, 1.0) for r in b.records]
    assert all(r.tp.partition == 0 for r in rest) and len(rest) == 2


def test_over_bound_names_full_lanes() -> None:
    cfg = lanes({"name": "a", "queue_bound": 3}, {"name": "b", "queue_bound": 100})
    s = PriorityScheduler(cfg, "a")
    feed(s, recs(3, "a") + recs(5, "b"), 0.0)
    assert s.over_bound() == {"a"}
    assert s.queued("a") == 3 and s.queued("b") == 5 and len(s) == 8
    s.next_batch(0.0)
    assert s.over_bound() == set()


def test_oom_lowering_cuts_queued_batches_and_windows() -> None:
    s = two_lanes(batch=8, wait_ms=50)
    full = recs(8, "lo")
    feed(s, full, 0.0)  # one ready batch of 8
    feed(s, recs(6, "lo"), 0.0)  # an open window of 6
    s.set_max_batch_size("lo", 3)
    assert s.max_batch_size("lo") == 3
    out = drain(s, 0.0, idle=False)
    # the ready 8 is cut down and the window split on poll; short pieces are topped up from behind
    assert [len(b) for b in out] == [3, 3, 3, 3, 2]
    assert all(b.max_batch_size == 3 for b in out)
    assert ids(out[0].records + out[1].records + out[2].records[:2]) == ids(full)
    s.set_max_batch_size("lo", 8)  # raised back
    feed(s, recs(8, "lo"), 1.0)
    b = s.next_batch(1.0, idle=False)
    assert b is not None and len(b) == 8


@pytest.mark.parametrize("policy", ["fixed", "adaptive"])
def test_observe_feeds_the_lane_model_and_the_shared_one_also_for_an_unknown_lane(policy: str) -> None:
    s = two_lanes(policy)
    for n, sec in ((4, 0.012), (8, 0.016), (16, 0.024)):  # a = 8 ms, b = 1 ms
        s.observe("nope", n, sec)  # no such lane: not an error, and the shared model still learns
    st = s.stats()
    assert st["hi"]["latency_a_s"] == pytest.approx(0.008) and st["hi"]["latency_b_s"] == pytest.approx(0.001)
    for n, sec in ((4, 0.024), (8, 0.032), (16, 0.048)):  # a = 16 ms, b = 2 ms: hi's own model, once ready
        s.observe("hi", n, sec)
    st = s.stats()
    assert st["hi"]["latency_a_s"] == pytest.approx(0.016) and st["hi"]["latency_b_s"] == pytest.approx(0.002)
    assert st["lo"]["latency_a_s"] is not None  # lo has seen nothing itself: the shared model answers for it


# ---------------------------------------------------------------- adaptive policy


def trained(policy: str = "adaptive", a: float = 0.010, b: float = 0.001, batch: int = 4,
            wait_ms: float = 10.0) -> PriorityScheduler:
    s = two_lanes(policy, batch=batch, wait_ms=wait_ms)
    for n in (1, 2, 4, 8, 1, 3):
        for lane in ("hi", "lo", "default"):
            s.observe(lane, n, a + b * n)
    return s


def test_adaptive_expires_early_what_cannot_make_it() -> None:
    s = trained(a=0.010, b=0.001, batch=8, wait_ms=100)
    doomed = rec("lo", deadline=1.005)  # 5 ms left, a batch takes >= 11 ms
    fine = rec("lo", deadline=1.5)
    feed(s, [doomed, fine], 1.0)
    assert s.next_wakeup(1.0) == pytest.approx(1.005 - 0.011)
    assert s.expire(1.0) == [doomed]
    assert s.queued("lo") == 1
    fixed = trained("fixed", batch=8, wait_ms=100)
    feed(fixed, [rec("lo", deadline=1.005)], 1.0)
    assert fixed.expire(1.0) == []  # the fixed policy waits for the deadline itself


def test_adaptive_dispatch_keeps_only_records_that_make_it() -> None:
    s = trained(a=0.010, b=0.001, batch=8, wait_ms=100)
    tight = [rec("lo", deadline=1.0125) for _ in range(4)]  # alone: 11 ms; in a batch of 8: 18 ms
    loose = [rec("lo", deadline=2.0) for _ in range(2)] + [rec("lo") for _ in range(2)]
    feed(s, tight + loose, 1.0)
    b = s.next_batch(1.0)
    assert b is not None
    # 4 loose always stay; adding tight ones: 5 -> 15 ms ok? no (12.5 ms budget): all tight dropped
    assert ids(b.records) == ids(loose)
    assert ids(s.expire(1.0)) == ids(tight)


def test_adaptive_keeps_as_many_tight_records_as_fit() -> None:
    s = trained(a=0.010, b=0.001, batch=8, wait_ms=100)
    tight = [rec("lo", deadline=1.0 + 0.0125 + 0.0001 * i) for i in range(4)]  # 12.5..12.8 ms budget
    feed(s, tight, 1.0)
    b = s.next_batch(1.0)
    # k records take 10 + k ms: 2 fit (12 ms), 3 would need 13 ms > every budget
    assert b is not None and ids(b.records) == ids(tight[2:])
    assert ids(s.expire(1.0)) == ids(tight[:2])


@settings(max_examples=examples(200), deadline=None)
@given(budgets=st.lists(st.one_of(st.none(), st.floats(0.005, 0.03)), min_size=1, max_size=8))
def test_adaptive_dispatch_keeps_a_largest_set_that_meets_its_deadlines(budgets: list[float | None]) -> None:
    s = trained(a=0.010, b=0.001, batch=8, wait_ms=100)
    a, b = s.stats()["lo"]["latency_a_s"], s.stats()["lo"]["latency_b_s"]
    rs = [rec("lo", deadline=None if x is None else 1.0 + x) for x in budgets]
    feed(s, rs, 1.0)
    batch = s.next_batch(1.0)
    kept = batch.records if batch is not None else []
    dropped = s.expire(1.0)
    assert sorted(r.offset for r in kept + dropped) == sorted(r.offset for r in rs)
    assert all(r.deadline is None or r.deadline >= 1.0 + a + b * len(kept) for r in kept)
    assert all(r.deadline is not None for r in dropped)
    if dropped:  # taking even the most relaxed dropped record along would make someone late
        assert max(r.deadline or 0.0 for r in dropped) < 1.0 + a + b * (len(kept) + 1)


def arrivals_while_busy(s: PriorityScheduler, clock: FakeClock, lane: str) -> None:
    """40 records of ``lane``, one a millisecond, while a busy device drains count batches: the lane's
    arrival rate (~1000/s) learnt; then everything drained."""
    for _ in range(40):
        s.add(rec(lane), clock.now())
        s.next_batch(clock.now(), idle=False)
        clock.advance(0.001)
    drain(s, clock.now(), idle=False)


def test_adaptive_waits_when_arrivals_pay_for_the_fixed_cost() -> None:
    # a = 20 ms per batch; records arrive every 1 ms: waiting for a fuller batch raises throughput
    s = trained(a=0.020, b=0.0005, batch=8, wait_ms=50)
    clock = FakeClock(1.0)
    arrivals_while_busy(s, clock, "lo")
    assert s.stats()["lo"]["arrival_rate"] > 500
    s.add(rec("lo"), clock.now())  # device free, one record open: k=1 < lam*a ~ 20
    assert s.next_batch(clock.now(), idle=True) is None
    wake = s.next_wakeup(clock.now())
    assert wake is not None and clock.now() < wake <= clock.now() + 0.050
    for _ in range(7):
        clock.advance(0.001)
        s.add(rec("lo"), clock.now())
    b = s.next_batch(clock.now(), idle=False)
    assert b is not None and len(b) == 8 and b.reason == "count"


def test_adaptive_does_not_wait_past_a_deadline() -> None:
    s = trained(a=0.020, b=0.0005, batch=8, wait_ms=50)
    clock = FakeClock(1.0)
    arrivals_while_busy(s, clock, "lo")
    urgent = rec("lo", deadline=clock.now() + 0.0206)  # only just makes it if dispatched now
    s.add(urgent, clock.now())
    b = s.next_batch(clock.now(), idle=True)
    assert b is not None and b.records == [urgent] and b.reason == "adaptive"


def test_adaptive_goes_at_once_when_waiting_cannot_pay() -> None:
    s = trained(a=0.001, b=0.002, batch=8, wait_ms=50)  # tiny fixed cost: no reason to wait
    s.add(rec("lo"), 1.0)
    b = s.next_batch(1.0)
    assert b is not None and b.reason == "adaptive"


def test_adaptive_without_observations_behaves_like_fixed() -> None:
    s = two_lanes("adaptive", batch=8)
    s.add(rec("lo", deadline=1.0001), 1.0)
    assert s.expire(1.0) == []
    b = s.next_batch(1.0)
    assert b is not None and len(b) == 1


def _holding_hi(lo_a: float) -> tuple[PriorityScheduler, FakeClock]:
    """hi (20 ms fixed cost, ~1000 records/s) holds its window; lo's batches cost ``lo_a``."""
    s = two_lanes("adaptive", batch=8, wait_ms=50)
    for n in (1, 2, 4, 8):
        s.observe("hi", n, 0.020 + 0.0005 * n)
        s.observe("lo", n, lo_a + 0.0001 * n)
    clock = FakeClock(1.0)
    arrivals_while_busy(s, clock, "hi")
    s.add(rec("hi"), clock.now())
    assert s.next_batch(clock.now()) is None  # hi holds: ~7 ms until its window should be full
    return s, clock


def test_adaptive_fills_the_gap_while_holding() -> None:
    s, clock = _holding_hi(lo_a=0.001)
    lo = recs(2, "lo")
    feed(s, lo, clock.now())
    b = s.next_batch(clock.now())  # lo's ~1.2 ms batch ends before hi's hold: served in the gap
    assert b is not None and b.lane == "lo" and b.records == lo
    assert s.next_batch(clock.now()) is None  # hi still holds


def test_adaptive_gap_filler_must_end_before_the_hold() -> None:
    s, clock = _holding_hi(lo_a=0.030)
    s.add(rec("lo"), clock.now())
    assert s.next_batch(clock.now()) is None  # a 30 ms lo batch would delay hi: wait
    wake = s.next_wakeup(clock.now())
    assert wake is not None and wake < clock.now() + 0.010


# ---------------------------------------------------------------- invariants under random operations

_add = st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 3),
                 st.sampled_from([None, 0.001, 0.01, 0.023, 0.05]))
_next = st.tuples(st.just("next"), st.booleans(), st.just(0), st.just(None))
# take a batch ahead (device busy)
_ahead = st.tuples(st.just("ahead"), st.just(0), st.just(0), st.just(None))
# the device starts it (Runner._swap)
_start = st.tuples(st.just("start"), st.just(0), st.just(0), st.just(None))
op_st = st.one_of(
    _add, _add, _add, _next, _next,
    st.tuples(st.just("tick"), st.integers(1, 20), st.just(0), st.just(None)),
    st.tuples(st.just("expire"), st.just(0), st.just(0), st.just(None)),
    st.tuples(st.just("revoke"), st.integers(0, 3), st.just(0), st.just(None)),
    st.tuples(st.just("max"), st.integers(0, 2), st.integers(1, 6), st.just(None)),
    st.tuples(st.just("observe"), st.integers(0, 2), st.integers(1, 6), st.just(None)),
    st.tuples(st.just("flush"), st.just(0), st.just(0), st.just(None)),
    _ahead, _ahead, _start, _start,
)


@settings(max_examples=examples(200), deadline=None)
@example(  # a preempted default batch's record fills the high batch before a waiting lo record
    ops=[("add", 0, 0, None), ("add", 0, 0, None), ("add", 1, 0, None), ("max", 2, 1, None),
         ("add", 0, 0, None), ("add", 0, 0, None), ("add", 0, 0, None), ("add", 2, 0, None),
         ("next", False, 0, None), ("tick", 5, 0, None), ("ahead", 0, 0, None)],
    policy="fixed", bucket=0, weights=(1, 1), fixed_cost=None, fill=True, eff=1.0)
@given(ops=st.lists(op_st, min_size=10, max_size=80), policy=st.sampled_from(["fixed", "adaptive"]),
       bucket=st.sampled_from([0, 2]), weights=st.tuples(st.integers(1, 4), st.integers(1, 4)),
       fixed_cost=st.sampled_from([None, 0.002, 0.020]), fill=st.booleans(),
       eff=st.sampled_from([1.0, 0.97, 0.5]))
def test_every_record_comes_out_exactly_once(ops: list[tuple[str, object, int, float | None]], policy: str,
                                             bucket: int, weights: tuple[int, int],
                                             fixed_cost: float | None, fill: bool, eff: float) -> None:
    cfg = lanes({"name": "hi", "priority": 5, "weight": weights[0], "max_batch_size": 4, "max_wait_ms": 5,
                 "fill_with_lower": fill, "fill_efficiency": eff},
                {"name": "lo", "priority": 1, "weight": weights[1], "max_batch_size": 3, "max_wait_ms": 0,
                 "fill_with_lower": fill, "fill_efficiency": eff},
                {"name": "default", "max_batch_size": 5, "max_wait_ms": 20, "queue_bound": 4})
    s = PriorityScheduler(cfg, "default", policy, bucket_width=bucket)
    if fixed_cost is not None:  # a trained latency model, so the adaptive paths (hold, expire early) run
        for n in (1, 3, 5):
            s.observe("default", n, fixed_cost + 0.001 * n)

    def check(b: Batch, _taken_ahead: Batch | None) -> None:
        others = b.records[len([r for r in b.records if r.lane == b.lane]):]
        assert not others or b.mixed
        # A preempted batch's front records fill the preempting batch first (they are the oldest); what
        # follows them is filled from the lower lanes, higher priority first.
        donor = play.donor_lane
        while donor is not None and others and others[0].lane == donor:
            others = others[1:]
        assert [PRIORITY[r.lane] for r in others] == sorted((PRIORITY[r.lane] for r in others), reverse=True)

    play = SchedulerPlay(s, bucket, check)
    for op, a1, a2, a3 in ops:
        # Here a ``start`` with nothing taken ahead flushes: it keeps flushes frequent in the streams.
        play.apply("flush" if op == "start" and not play.pending else op, a1, a2, a3)
        for lane in s._lanes.values():
            assert all(x.records for x in lane.ready)
        w = s.next_wakeup(play.now)
        assert w is None or w == w  # never NaN
    play.finish()


_arrivals = st.lists(st.tuples(st.integers(0, 2), st.sampled_from([None, 0.004, 0.03])), max_size=9)


@settings(max_examples=examples(150), deadline=None)
@given(cycles=st.lists(st.tuples(_arrivals, st.integers(0, 25), st.integers(0, 6)), min_size=5, max_size=40),
       policy=st.sampled_from(["fixed", "adaptive"]), bucket=st.sampled_from([0, 0, 2]), fill=st.booleans(),
       eff=st.sampled_from([1.0, 0.97, 0.5]))
def test_the_device_pipeline_with_top_ups_runs_every_record_exactly_once(
        cycles: list[tuple[list[tuple[int, float | None]], int, int]], policy: str, bucket: int, fill: bool,
        eff: float) -> None:
    """The runner's pipeline on one device: while a batch runs the next is taken ahead (full_only), records
    arrive, and when the device frees up the batch taken ahead is started as Runner._swap does (start,
    drop_expired, preempt, else top_up). Such a batch is often partial by then (deadlines, a raised limit) and
    is topped up, so this exercises top_up far more often than the random-operations test does."""
    cfg = lanes({"name": "hi", "priority": 5, "max_batch_size": 4, "max_wait_ms": 5, "fill_with_lower": fill,
                 "fill_efficiency": eff},
                {"name": "lo", "priority": 1, "max_batch_size": 3, "max_wait_ms": 2, "fill_with_lower": fill,
                 "fill_efficiency": eff},
                {"name": "default", "max_batch_size": 5, "max_wait_ms": 20})
    s = PriorityScheduler(cfg, "default", policy, bucket_width=bucket)
    for n in (1, 3, 5):
        s.observe("default", n, 0.002 + 0.001 * n)
    now = 0.0
    added: set[int] = set()
    out: list[int] = []
    running: Batch | None = None

    def check(b: Batch, size_ok: int = 0) -> None:
        assert b.records and len(b) <= max(s.max_batch_size(b.lane), size_ok)
        own = [r for r in b.records if r.lane == b.lane]
        assert b.records[:len(own)] == own, "the batch's own lane first"
        assert all(PRIORITY[r.lane] < PRIORITY[b.lane] for r in b.records[len(own) :]), (
            "filled only from lower lanes"
        )
        assert all(r.deadline is None or r.deadline > now for r in b.records), "expired record dispatched"
        if bucket:
            assert len({r.size // bucket for r in b.records}) == 1
        out.extend(r.offset for r in b.records)

    for arrivals, tick_ms, raise_to in cycles:
        ahead = s.next_batch(now, idle=False, full_only=True) if running is not None else None
        for lane, deadline in arrivals:
            r = rec(LANES[lane], size=len(added) % 4, deadline=None if deadline is None else now + deadline)
            added.add(r.offset)
            out.extend(x.offset for x in s.add(r, now))
        if raise_to:
            s.set_max_batch_size(LANES[raise_to % 3], raise_to)
        out.extend(x.offset for x in s.expire(now))  # (the loop thread's; not right before the start)
        now += tick_ms / 1000.0
        running = None  # the device is free
        if ahead is not None:
            assert s.start(ahead)
            trimmed = s.drop_expired(ahead, now)
            cur = trimmed if trimmed is not None else ahead
            if cur.records:
                run = s.preempt(cur, now) or s.top_up(cur, now)
                if run is None:
                    check(cur, size_ok=len(cur))
                    running = cur
                else:
                    check(run)
                    running = run
        if running is None:
            running = s.next_batch(now, idle=True)
            if running is not None:
                check(running)
        for lane in s._lanes.values():
            assert lane.n == len(lane.batcher) + lane.ready_n - len(lane.dead)
            assert lane.ready_n == sum(len(x.records) for x in lane.ready)
            assert lane.ahead == 0
    s.flush(now)
    while (b := s.next_batch(now, idle=True)) is not None:
        check(b)
    out.extend(r.offset for r in s.expire(now))
    assert len(s) == 0
    assert len(out) == len(set(out)), "a record came out twice"
    assert set(out) == added, "a record was lost"


# ---------------------------------------------------------------- prefetch while the device is busy

def test_busy_device_prefetches_only_full_batches_and_an_idle_one_tops_up_partial_ones() -> None:
    s = two_lanes(batch=4, wait_ms=10.0)
    early = recs(2, "lo")
    feed(s, early, now=0.0)
    # The window closes by time while the device is busy: a prefetch (full_only) leaves it to fill.
    assert s.next_batch(0.011, idle=False, full_only=True) is None
    late = recs(1, "lo")
    feed(s, late, now=0.012)
    # Without full_only the busy device would have taken the 2-record batch; with it, once the device is
    # free, the partial batch goes with the record that arrived meanwhile.
    b = s.next_batch(0.013, idle=True)
    assert b is not None and ids(b.records) == ids(early + late)
    assert len(s) == 0


def test_busy_device_still_prefetches_a_full_batch() -> None:
    s = two_lanes(batch=4, wait_ms=10.0)
    rs = recs(4, "lo")
    feed(s, rs, now=0.0)
    b = s.next_batch(0.001, idle=False, full_only=True)
    assert b is not None and ids(b.records) == ids(rs) and b.reason == "count"


def test_busy_device_does_not_prefetch_a_higher_lanes_partial_batch() -> None:
    s = two_lanes(batch=4, wait_ms=10.0)
    feed(s, recs(8, "lo"), now=0.0)
    feed(s, recs(1, "hi"), now=0.0)
    # The high window closed by time but the device is busy: taking it now would leave behind the high
    # records arriving until the device is free. The full low batch is prefetched.
    b = s.next_batch(0.011, idle=False, full_only=True)
    assert b is not None and b.lane == "lo" and len(b.records) == 4


def test_preempt_swaps_a_prefetched_low_batch_for_the_high_lanes_records_and_requeues_it() -> None:
    s = two_lanes(batch=4, wait_ms=10.0)
    low = recs(8, "lo")
    feed(s, low, now=0.0)
    pre = s.next_batch(0.001, idle=False, full_only=True)
    assert pre is not None and pre.lane == "lo"
    high = recs(3, "hi")
    feed(s, high[:2], now=0.002)
    feed(s, high[2:], now=0.020)  # the first two closed by time, the third still in an open window
    served_before = s.stats()["lo"]["served_records"]
    b = s.preempt(pre, now=0.021)
    # The device is about to be free: every high record goes, the closed batch topped up from the window.
    assert b is not None and b.lane == "hi" and ids(b.records) == ids(high)
    st = s.stats()["lo"]
    assert st["queued"] == 8 and st["served_records"] == served_before - 4
    # The prefetched batch is back at the front of its lane: the next batch is the same records, in order.
    again = s.next_batch(0.022, idle=True)
    assert again is not None and ids(again.records) == ids(pre.records)
    rest = s.next_batch(0.023, idle=True)
    assert rest is not None and ids(rest.records) == ids(low[4:])
    assert len(s) == 0


def test_preempt_leaves_an_open_high_window_to_fill() -> None:
    s = two_lanes(batch=4, wait_ms=10.0)
    feed(s, recs(8, "lo"), now=0.0)
    pre = s.next_batch(0.001, idle=False, full_only=True)
    assert pre is not None
    feed(s, recs(1, "hi"), now=0.002)
    assert s.preempt(pre, now=0.005) is None  # opened 3 ms ago, max_wait 10 ms: not closed yet
    assert s.preempt(pre, now=0.013) is not None  # closed by time


def test_preempt_keeps_the_prefetched_batch_when_nothing_higher_is_queued() -> None:
    s = two_lanes(batch=4, wait_ms=10.0)
    feed(s, recs(8, "lo"), now=0.0)
    pre = s.next_batch(0.001, idle=False, full_only=True)
    assert pre is not None
    assert s.preempt(pre, now=0.002) is None
    assert s.stats()["lo"]["queued"] == 4


def test_preempt_never_goes_to_a_lower_or_equal_priority_lane() -> None:
    s = two_lanes(batch=4, wait_ms=10.0)
    feed(s, recs(4, "hi"), now=0.0)
    pre = s.next_batch(0.001, idle=False, full_only=True)
    assert pre is not None and pre.lane == "hi"
    feed(s, recs(4, "lo"), now=0.002)
    assert s.preempt(pre, now=0.003) is None


def test_preemption_keeps_the_low_lanes_guaranteed_share_under_overload() -> None:
    # The runner's loop under overload: prefetch a full batch while busy, then offer the high lane a swap
    # just before the start. The high lane always has records (partial batches), the low lane a backlog.
    s = two_lanes(batch=4, wait_ms=10.0, hi_weight=4.0, lo_weight=1.0)
    served = {"hi": 0, "lo": 0}
    now = 0.0
    for _ in range(400):
        if s.queued("lo") < 12:
            feed(s, recs(12, "lo"), now=now)
        feed(s, recs(1, "hi"), now=now)
        pre = s.next_batch(now, idle=False, full_only=True)
        # The only full batches are low ones; a high partial batch goes ahead only when the high lane is owed
        # the device (a batch of lag behind), else through preempt.
        assert pre is not None
        now += 0.005
        b = s.preempt(pre, now) or pre
        served[b.lane] += len(b.records)
        now += 0.005
    low_share = served["lo"] / (served["hi"] + served["lo"])
    assert served["hi"] > 0
    assert low_share >= 1.0 / 5.0 - 0.02, served  # w_lo / (w_lo + w_hi), minus a few batches


def test_preempted_records_keep_their_deadlines() -> None:
    s = two_lanes(batch=4, wait_ms=10.0)
    low = recs(4, "lo")
    for r in low:
        r.deadline = 0.05
    feed(s, low, now=0.0)
    pre = s.next_batch(0.001, idle=False, full_only=True)
    assert pre is not None
    feed(s, recs(1, "hi"), now=0.002)
    assert s.preempt(pre, now=0.013) is not None
    expired = s.expire(0.06)  # still tracked: past the deadline they come out as expired, not lost
    assert ids(expired) == ids(low)
    assert len(s) == 0


# ---------------------------------------------------------------- fill_with_lower

def filling_lanes(batch: int = 4, wait_ms: float = 10.0, **kw: object) -> PriorityScheduler:
    """``hi`` fills its partial batches from lower lanes; ``mid`` (priority 5) and ``lo`` (0) do not."""
    cfg = lanes({"name": "hi", "priority": 10, "max_batch_size": batch, "max_wait_ms": wait_ms,
                 "fill_with_lower": True},
                {"name": "mid", "priority": 5, "max_batch_size": batch, "max_wait_ms": wait_ms},
                {"name": "lo", "priority": 0, "max_batch_size": batch, "max_wait_ms": wait_ms})
    return PriorityScheduler(cfg, "lo", **kw)  # type: ignore[arg-type]


def test_fill_tops_up_a_partial_batch_with_the_oldest_lower_lane_records() -> None:
    s = filling_lanes(batch=4)
    low, mid, high = recs(3, "lo"), recs(1, "mid"), recs(2, "hi")
    feed(s, low, now=0.0)
    feed(s, mid, now=0.001)
    feed(s, high, now=0.002)
    b = s.next_batch(0.003, idle=True)
    # The high lane's records first, then the next lane down (mid), then the lowest, oldest first.
    assert b is not None and b.lane == "hi" and b.mixed
    assert ids(b.records) == ids(high + mid + low[:1])
    assert [r.lane for r in b.records] == ["hi", "hi", "mid", "lo"]
    st = s.stats()
    assert (st["hi"]["queued"], st["mid"]["queued"], st["lo"]["queued"]) == (0, 0, 2)
    assert (st["hi"]["served_records"], st["mid"]["served_records"], st["lo"]["served_records"]) == (2, 1, 1)
    rest = s.next_batch(0.004, idle=True)
    assert rest is not None and rest.lane == "lo" and not rest.mixed and ids(rest.records) == ids(low[1:])
    assert len(s) == 0


def test_fill_takes_lower_ready_batches_before_open_windows_and_never_a_higher_lane() -> None:
    s = filling_lanes(batch=4)
    closed, still_open = recs(2, "lo"), recs(1, "lo")
    feed(s, closed, now=0.0)
    feed(s, still_open, now=0.011)  # the first two closed by time at 0.010; this one opened a new window
    feed(s, recs(1, "hi"), now=0.012)
    b = s.next_batch(0.012, idle=True)
    assert b is not None and b.lane == "hi" and ids(b.records[1:]) == ids(closed + still_open)
    # A lane without the option is never topped up from others (mid is above lo).
    s = filling_lanes(batch=4)
    feed(s, recs(2, "lo"), now=0.0)
    feed(s, recs(1, "mid"), now=0.0)
    b = s.next_batch(0.001, idle=True)
    assert b is not None and b.lane == "mid" and len(b.records) == 1 and not b.mixed


def test_a_batch_taken_ahead_is_not_filled_and_a_full_batch_is_left_alone() -> None:
    s = filling_lanes(batch=4)
    feed(s, recs(4, "hi"), now=0.0)
    feed(s, recs(4, "lo"), now=0.0)
    b = s.next_batch(0.001, idle=True)
    assert b is not None and b.lane == "hi" and not b.mixed and len(b.records) == 4
    s = filling_lanes(batch=4)
    feed(s, recs(2, "hi"), now=0.0)
    feed(s, recs(4, "lo"), now=0.0)
    pre = s.next_batch(0.001, idle=False, full_only=True)
    assert pre is not None and pre.lane == "lo" and not pre.mixed


def test_preempt_fills_from_the_batch_it_displaces_and_requeues_the_rest_in_order() -> None:
    s = filling_lanes(batch=4)
    low = recs(8, "lo")
    feed(s, low, now=0.0)
    pre = s.next_batch(0.001, idle=False, full_only=True)
    assert pre is not None and ids(pre.records) == ids(low[:4])
    high = recs(2, "hi")
    feed(s, high, now=0.002)
    b = s.preempt(pre, now=0.013)  # the high window closed by time
    # The displaced batch's front records are the oldest low ones: they fill the free slots.
    assert b is not None and b.lane == "hi" and b.mixed and ids(b.records) == ids(high + low[:2])
    assert s.stats()["lo"]["queued"] == 6 and s.stats()["lo"]["served_records"] == 2
    nxt = s.next_batch(0.014, idle=True)
    assert nxt is not None and ids(nxt.records) == ids(low[2:6])
    last = s.next_batch(0.015, idle=True)
    assert last is not None and ids(last.records) == ids(low[6:])
    assert len(s) == 0


def test_fill_records_leave_deadline_tracking_and_expired_ones_are_not_used() -> None:
    s = filling_lanes(batch=4)
    low = recs(3, "lo")
    low[0].deadline = 0.005
    for r in low[1:]:
        r.deadline = 1.0
    feed(s, low, now=0.0)
    assert ids(s.expire(0.006)) == ids(low[:1])  # expired: a tombstone stays in the lane until the front
    feed(s, recs(1, "hi"), now=0.007)
    b = s.next_batch(0.008, idle=True)
    assert b is not None and ids(b.records[1:]) == ids(low[1:])
    assert s.expire(2.0) == [] and len(s) == 0  # the filled records are no longer tracked


def test_fill_is_off_with_size_bucketing() -> None:
    s = filling_lanes(batch=4, bucket_width=8)
    feed(s, recs(2, "lo"), now=0.0)
    feed(s, recs(1, "hi"), now=0.0)
    b = s.next_batch(0.001, idle=True)
    assert b is not None and b.lane == "hi" and len(b.records) == 1 and not b.mixed


def test_with_size_buckets_a_partial_batch_is_topped_up_past_other_buckets() -> None:
    # Each bucket's window closes by time on its own, so the ready FIFO interleaves buckets: a partial batch
    # of short records, a full one of long records, then more short ones. The partial batch takes the later
    # short records along instead of running half empty (and leaving them another partial batch).
    s = PriorityScheduler(lanes({"name": "default", "max_batch_size": 4, "max_wait_ms": 10}), "default",
                          "fixed",
                          bucket_width=8)
    short_early, long, short_late = recs(2, size=3), recs(4, size=20), recs(3, size=5)
    feed(s, short_early, now=0.0)
    assert s.next_batch(0.011, idle=False, full_only=True) is None  # closed by time while the device is busy
    feed(s, long, now=0.012)  # a full batch of another bucket
    feed(s, short_late, now=0.013)  # closes by time at 0.023
    got = drain(s, now=0.030)
    assert [ids(b.records) for b in got] == [ids(short_early + short_late[:2]), ids(long),
                                             ids(short_late[2:])]
    assert len(s) == 0 and s.stats()["default"]["ready_batches"] == 0


@pytest.mark.parametrize(("scan", "topped_up"), [(2, False), (3, True)])
def test_the_bucket_top_up_looks_only_so_far_down_the_ready_batches(monkeypatch: pytest.MonkeyPatch,
                                                                    scan: int,
                                                                      topped_up: bool) -> None:
    # The later record of the short batch's bucket is the third ready batch behind it: found when the scan
    # reaches that far, left for its own batch when not (the scan is bounded: a lane can hold thousands).
    monkeypatch.setattr(lane_module, "TOP_UP_SCAN", scan)
    s = PriorityScheduler(lanes({"name": "default", "max_batch_size": 4, "max_wait_ms": 10}), "default",
                          "fixed",
                          bucket_width=8)
    early, mid, far, late = recs(1, size=3), recs(4, size=20), recs(4, size=40), recs(1, size=3)
    feed(s, early, now=0.0)
    assert s.next_batch(0.011, idle=False, full_only=True) is None
    feed(s, mid + far, now=0.012)
    feed(s, late, now=0.013)
    got = [ids(b.records) for b in drain(s, now=0.030)]
    if topped_up:
        assert got == [ids(early + late), ids(mid), ids(far)]
    else:
        assert got == [ids(early), ids(mid), ids(far), ids(late)]


def trained_filling(a: float = 0.010, b: float = 0.001, batch: int = 8) -> PriorityScheduler:
    s = filling_lanes(batch=batch, wait_ms=100.0, policy="adaptive")
    for n in (1, 2, 4, 8, 1, 3):
        for lane in ("hi", "mid", "lo"):
            s.observe(lane, n, a + b * n)
    return s


def test_adaptive_fill_stops_where_the_batch_would_miss_its_own_deadline() -> None:
    s = trained_filling(a=0.010, b=0.001, batch=8)
    feed(s, recs(10, "lo"), now=1.0)
    urgent = rec("hi", deadline=1.0155)  # room for a + b*5 = 15 ms: itself and 4 more
    feed(s, [urgent], now=1.0)
    b = s.next_batch(1.0, idle=True)
    assert b is not None and b.records[0] is urgent and len(b.records) == 5


def test_adaptive_fill_leaves_alone_a_lane_whose_deadline_the_filled_batch_would_miss() -> None:
    s = trained_filling(a=0.010, b=0.001, batch=8)
    # One of these alone would end at 1.011, in time; the filled batch (up to 8 records) would end at 1.018.
    tight = recs(3, "lo", deadline=1.012)
    easy = recs(3, "mid", deadline=2.0)
    feed(s, tight + easy, now=1.0)
    feed(s, recs(1, "hi"), now=1.0)
    b = s.next_batch(1.0, idle=True)
    assert b is not None and b.lane == "hi" and ids(b.records[1:]) == ids(easy)
    # Not taken, so not expired on the filled batch's account: still queued, and their own batch is next.
    assert s.expire(1.0) == [] and s.queued("lo") == 3
    own = s.next_batch(1.0, idle=True)  # (two of the three fit: 10 + 2 ms; the adaptive rule keeps those)
    assert (
        own is not None
        and own.lane == "lo"
        and len(own.records) == 2
        and set(ids(own.records)) < set(ids(tight))
    )


def test_adaptive_preempt_fills_from_the_displaced_batch_only_where_its_deadlines_hold() -> None:
    s = trained_filling(a=0.010, b=0.001, batch=8)
    low = recs(8, "lo")
    for r in low:
        r.deadline = 1.5
    feed(s, low, now=1.0)
    pre = s.next_batch(1.0, idle=False, full_only=True)
    assert pre is not None and len(pre.records) == 8
    feed(s, recs(2, "hi"), now=1.0)
    b = s.preempt(pre, now=1.2)  # the high window closed by time (100 ms)
    # 8 slots: 2 high + 6 from the displaced batch
    assert b is not None and ids(b.records[2:]) == ids(low[:6])
    s = trained_filling(a=0.010, b=0.001, batch=8)
    low = recs(8, "lo")
    for r in low:
        r.deadline = 1.2165  # a batch of 8 started at 1.2 ends at 1.218: too late
    feed(s, low, now=1.0)
    pre = s.next_batch(1.0, idle=False, full_only=True)
    assert pre is not None
    feed(s, recs(2, "hi"), now=1.0)
    b = s.preempt(pre, now=1.2)
    # 2 high + 6 low would end at 1.218 > 1.2165: none is put where it would be late; the displaced batch
    # goes back whole (the adaptive rules decide about it in its own turn).
    assert b is not None and b.lane == "hi" and len(b.records) == 2 and not b.mixed
    assert s.queued("lo") == 8


# ---------------------------------------------------------------- batches taken ahead (the device is busy)
def _run_overloaded(s: PriorityScheduler, steps: int, arrivals: dict[int, dict[str, int]],
                    every: dict[str, int]) -> list[tuple[int, str, int]]:
    """The runner's pattern with one device under overload: the device always holds a batch taken ahead
    (``next_batch(idle=False, full_only=True)``) and runs it after ``start`` and ``preempt``. Returns (step,
    lane, size) per batch run."""
    now, pref, served = 0.0, None, []
    for i in range(steps):
        now += 0.05  # one batch time
        for lane, k in {**every, **arrivals.get(i, {})}.items():
            for _ in range(k):
                s.add(rec(lane), now)
        if pref is not None:
            s.start(pref)
            b = s.preempt(pref, now) or pref
            served.append((i, b.lane, len(b.records)))
        pref = s.next_batch(now, idle=False, full_only=True) or s.next_batch(now, idle=True)
    return served


def test_a_lane_with_only_partial_batches_is_not_starved_by_full_ones() -> None:
    """Under overload the device is never idle, so only batches taken ahead run. A low lane whose window
    closes by time with 5 records used to wait forever while the high lane kept filling batches."""
    s = two_lanes(batch=32)
    served = _run_overloaded(s, 200, {0: {"lo": 5}}, {"hi": 40})
    lo = [(i, n) for i, lane, n in served if lane == "lo"]
    assert lo and sum(n for _, n in lo) == 5
    assert lo[0][0] <= 5  # within a couple of batches: one batch of lag (L = 32) behind the high lane


def test_fair_shares_hold_with_batches_taken_ahead_and_a_trickling_lane() -> None:
    """Weights 9:1, the low lane trickles (1 record every 40 batch times), then bursts: the trickle is
    served as it comes, and the burst gets its ~1/10 share instead of a run of credit saved while it was
    left out (which then starved the high lane for 79 batches in a row)."""
    s = two_lanes(hi_weight=9, lo_weight=1, batch=32)
    trickle = {i: {"lo": 1} for i in range(0, 400, 40)}
    served = _run_overloaded(s, 800, {**trickle, 400: {"lo": 20_000}}, {"hi": 64})
    assert sum(n for i, lane, n in served if lane == "lo" and i < 400) == 10
    after = [lane for i, lane, _ in served if 400 <= i < 600]
    assert 10 <= after.count("lo") <= 30, after.count("lo")  # ~20 of 200 batches
    longest_lo = max((len(list(g)) for k, g in itertools.groupby(after) if k == "lo"), default=0)
    assert longest_lo <= 2


def test_records_of_a_batch_taken_ahead_that_expire_before_it_starts_are_not_run() -> None:
    s = two_lanes(batch=4)
    late = [rec("lo", deadline=0.03) for _ in range(2)]
    for r in [*late, rec("lo"), rec("lo")]:
        s.add(r, 0.0)
    pref = s.next_batch(0.0, idle=False, full_only=True)
    assert pref is not None and len(pref.records) == 4
    assert s.drop_expired(pref, 0.02) is None  # nothing late yet: run it as taken
    trimmed = s.drop_expired(pref, 0.05)
    assert (
        trimmed is not None
        and len(trimmed.records) == 2
        and not set(map(id, late)) & set(map(id, trimmed.records))
    )
    assert ids(s.expire(0.05)) == ids(late)
    st = s.stats()["lo"]
    assert (st["expired"], st["served_records"]) == (2, 2)  # not charged for what it did not run


def test_preemption_fill_takes_the_displaced_batch_front_first_also_with_deadlines() -> None:
    cfg = lanes({"name": "hi", "priority": 1, "max_batch_size": 8, "fill_with_lower": True},
                {"name": "lo", "priority": 0, "max_batch_size": 8})
    s = PriorityScheduler(cfg, "hi", "fixed")
    lo = [rec("lo", offset=i, deadline=1e9) for i in range(16)]
    for r in lo:
        s.add(r, 0.0)
    pref = s.next_batch(0.0, idle=False, full_only=True)
    for i in range(2):
        s.add(rec("hi", offset=100 + i), 0.0)
    out = s.preempt(pref, 0.02)  # hi's window closed by time
    assert out is not None
    assert [r.offset for r in out.records] == [100, 101, 0, 1, 2, 3, 4, 5]
    nxt = s.next_batch(0.02, idle=True)
    assert nxt is not None and [r.offset for r in nxt.records] == [6, 7, 8, 9, 10, 11, 12, 13]


def test_adaptive_fill_leaves_a_lower_lane_alone_if_its_own_model_says_it_would_miss() -> None:
    cfg = lanes({"name": "hi", "priority": 1, "max_batch_size": 8, "fill_with_lower": True},
                {"name": "lo", "priority": 0, "max_batch_size": 8})
    s = PriorityScheduler(cfg, "hi", "adaptive")
    for n in (1, 2, 4):
        s.observe("hi", n, 0.001 + 0.0001 * n)  # fast
        s.observe("lo", n, 0.001 + 0.01 * n)  # slow per record
    now = 10.0
    # fits alone (11 ms), not behind 3 more (41 ms by lo's model)
    low = rec("lo", offset=1, deadline=now + 0.03)
    s.add(low, now)
    for i in range(3):
        s.add(rec("hi", offset=100 + i), now)
    b = s.next_batch(now, idle=True)
    assert b is not None and [r.lane for r in b.records] == ["hi"] * 3
    assert s.expire(now) == []  # not expired on the filled batch's account
    alone = s.next_batch(now, idle=True)
    assert alone is not None and alone.records == [low]


@pytest.mark.parametrize("lo_batch", [32, 128])
def test_a_trickling_low_lane_runs_within_a_few_batches_under_overload(lo_batch: int) -> None:
    """A deep high-lane backlog, one low-lane record per high batch, the runner's pipeline: take ahead while
    the device is busy (full_only), then ``start`` and ``preempt`` when it is free. The low lane's batch is
    owed the device after a batch or two; it used to lose its lag at every arrival (all its records were in
    the batch taken ahead, so the new one made it "become backlogged" at the others' service) and be preempted
    again at every start until the batch was full: 31 high batches (1.7 s) at max batch 32, 127 (6.9 s) at
    128."""
    cfg = lanes({"name": "hi", "priority": 10, "weight": 1, "max_batch_size": 32, "max_wait_ms": 10},
                {"name": "lo", "priority": 0, "weight": 1, "max_batch_size": lo_batch, "max_wait_ms": 10})
    s = PriorityScheduler(cfg, "hi", "fixed")
    off = itertools.count()

    def add(lane: str, n: int, now: float) -> None:
        for _ in range(n):
            s.add(Record(TopicPartition(lane, 0), next(off), b"", lane=lane, received_at=now), now)

    now = 0.0
    add("hi", 32 * 300, now)
    add("lo", 1, now)
    assert s.next_batch(now, idle=True) is not None  # the device starts a high batch
    turns = 0
    while turns < 200:
        turns += 1
        ahead = s.next_batch(now + 0.001, idle=False, full_only=True)
        now += 0.052  # the running batch takes 52 ms; a low record arrives meanwhile
        add("lo", 1, now - 0.02)
        assert ahead is not None
        s.start(ahead)
        better = s.preempt(ahead, now)
        running = better if better is not None else ahead
        if any(r.lane == "lo" for r in running.records):
            break
    assert turns <= 6, f"the low lane first ran after {turns} high batches"


def _ahead_then_trimmed(s: PriorityScheduler, lane: str) -> Batch:
    """A full batch of ``lane`` taken ahead at 0 whose first two records (deadline 50 ms) expired by its start
    at 60 ms: what the device starts is a partial batch."""
    feed(s, [rec(lane, deadline=0.050), rec(lane, deadline=0.050), rec(lane), rec(lane)], now=0.0)
    ahead = s.next_batch(0.0, idle=False, full_only=True)
    assert ahead is not None and len(ahead.records) == 4
    assert s.start(ahead) is True
    trimmed = s.drop_expired(ahead, 0.060)
    assert trimmed is not None and len(trimmed.records) == 2
    assert s.preempt(trimmed, 0.060) is None
    return trimmed


def test_a_partial_batch_taken_ahead_takes_its_lanes_later_records_when_it_starts() -> None:
    s = two_lanes(batch=4)
    trimmed = _ahead_then_trimmed(s, "lo")
    later = recs(3, "lo")
    feed(s, later, now=0.030)  # arrived while the device was busy: an open window
    out = s.top_up(trimmed, 0.060)
    assert out is not None and ids(out.records) == ids(trimmed.records + later[:2])
    assert not out.mixed and len(trimmed.records) == 2  # (the batch given is not changed)
    assert s.queued("lo") == 1 and len(s) == 1
    assert s.top_up(out, 0.060) is None  # full
    rest = s.next_batch(0.060, idle=True)
    assert rest is not None and ids(rest.records) == ids(later[2:])
    assert s.next_batch(0.060, idle=True) is None


def test_a_fill_lane_partial_batch_taken_ahead_is_filled_when_it_starts_its_own_records_first() -> None:
    """``fill_with_lower`` used to fill only the batches a free device took: under 2x overload a 50 ms
    high-lane window's batches were taken ahead and ran unfilled (``overload_sim``: 0.84 of capacity instead
    of
    1.00)."""
    cfg = lanes({"name": "hi", "priority": 10, "max_batch_size": 4, "max_wait_ms": 10,
                 "fill_with_lower": True},
                {"name": "lo", "max_batch_size": 4, "max_wait_ms": 10})
    s = PriorityScheduler(cfg, "lo", "fixed")
    trimmed = _ahead_then_trimmed(s, "hi")
    lo = recs(3, "lo")
    feed(s, lo, now=0.010)
    hi = rec("hi")
    feed(s, [hi], now=0.040)
    out = s.top_up(trimmed, 0.060)
    assert out is not None and out.mixed and out.lane == "hi"
    assert ids(out.records) == ids(trimmed.records + [hi] + lo[:1])
    assert s.queued("lo") == 2 and s.queued("hi") == 0


def test_no_top_up_with_size_buckets_or_for_a_full_batch() -> None:
    s = two_lanes(batch=4, bucket_width=2)
    trimmed = _ahead_then_trimmed(s, "lo")
    feed(s, recs(2, "lo"), now=0.030)
    assert s.top_up(trimmed, 0.060) is None  # a bucket's batch would take records of other sizes
    s = two_lanes(batch=4)
    feed(s, recs(4, "lo"), now=0.0)
    full = s.next_batch(0.0, idle=False, full_only=True)
    assert full is not None and s.start(full)
    feed(s, recs(2, "lo"), now=0.001)
    assert s.top_up(full, 0.010) is None


def test_start_says_whether_the_batch_was_taken_ahead() -> None:
    s = two_lanes(batch=4)
    feed(s, recs(4, "lo") + recs(1, "hi"), now=0.0)
    free = s.next_batch(0.0, idle=True)  # a free device: hi's open window
    assert free is not None and s.start(free) is False
    ahead = s.next_batch(0.0, idle=False, full_only=True)
    assert ahead is not None and s.start(ahead) is True and s.start(ahead) is False


def test_the_adaptive_fill_takes_a_record_without_a_finite_deadline() -> None:
    """The fill's room is computed from the batch's earliest deadline: an infinite one (a lane set up outside
    the config's checks) raised OverflowError at dispatch."""
    cfg = lanes({"name": "default", "fill_with_lower": True}, {"name": "bulk", "priority": -1})
    s = PriorityScheduler(cfg, "default", "adaptive")
    for n in (1, 3, 5):
        s.observe("default", n, 0.002 + 0.001 * n)
    s.add(rec("default", deadline=float("inf")), 0.0)
    s.add(rec("bulk"), 0.0)
    b = s.next_batch(0.0, idle=True)
    assert b is not None and [r.lane for r in b.records] == ["default", "bulk"]


def test_a_full_lane_stays_full_until_its_low_watermark() -> None:
    """A lane at its queue_bound paused its partitions and resumed them one record below it: at every loop
    turn a pause, a resume and a fetcher wake-up. Held lanes now stay full until queue_bound *
    resume_ratio."""
    cfg = lanes({"name": "default", "max_batch_size": 4, "queue_bound": 10, "max_wait_ms": 60_000})
    s = PriorityScheduler(cfg, "default", "fixed")
    for i in range(10):
        s.add(rec("default", offset=i), 0.0)
    assert s.over_bound() == {"default"}
    assert s.next_batch(0.0, idle=True) is not None  # 6 left
    assert s.over_bound() == set()  # not held: below the bound
    assert s.over_bound({"default"}, 0.5) == {"default"}  # held: 6 > 5
    assert s.next_batch(0.0, idle=True) is not None  # 2 left
    assert s.over_bound({"default"}, 0.5) == set()


def test_tombstones_left_alone_in_a_window_never_make_next_wakeup_overdue() -> None:
    """An expired record left in an open window as a tombstone (its lane still held live records) stayed there
    once those were dispatched: next_batch returned at once (nothing queued) without polling the window, and
    next_wakeup kept returning that window's close time, in the past for good. The device's wait became a busy
    loop (149 turns of the runner's lock in 50 ms). Revoking a lane's last live records did the same."""
    s = PriorityScheduler(lanes({"name": "default", "max_batch_size": 2, "max_wait_ms": 10}), "default")
    s.add(rec(), 0.0)
    s.add(rec(), 0.0)  # closed by count: a ready batch
    s.add(rec(deadline=0.005), 0.0)  # opens a window
    assert len(s.expire(0.006)) == 1  # a tombstone: two live records are still queued
    batch = s.next_batch(0.006, idle=True)
    assert batch is not None and len(batch.records) == 2 and len(s) == 0
    assert s.next_wakeup(1.0) is None
    s.add(late := rec(), 1.0)  # a new window, with its own max_wait (the stale one went out at once)
    assert s.next_batch(1.0, idle=False) is None and s.next_wakeup(1.0) == pytest.approx(1.01)
    assert s.next_batch(1.01, idle=False) is not None and late is not None

    s = PriorityScheduler(lanes({"name": "default", "max_batch_size": 8, "max_wait_ms": 10}), "default")
    s.add(rec(partition=1, deadline=0.005), 0.0)
    s.add(rec(partition=0), 0.0)
    assert len(s.expire(0.006)) == 1
    assert len(s.revoke({TopicPartition("in", 0)})) == 1 and len(s) == 0
    assert s.next_wakeup(1.0) is None


def test_a_filled_batch_a_free_device_took_is_not_preempted() -> None:
    """preempt() put a batch back in its own lane whole. A free device's batch filled from lower lanes (never
    taken ahead) was requeued with the lower lane's records booked to the filling lane: the lanes' counts,
    served records and fair-share service went wrong, and their results were counted under the wrong lane."""
    s = PriorityScheduler(lanes({"name": "hi", "priority": 10, "max_wait_ms": 1},
                                {"name": "mid", "priority": 5, "fill_with_lower": True},
                                {"name": "lo"}), "lo")
    s.add(rec("mid"), 0.0)
    for _ in range(3):
        s.add(rec("lo"), 0.0)
    b = s.next_batch(0.0, idle=True)
    assert b is not None and b.mixed and len(b.records) == 4
    s.add(rec("hi"), 0.0)
    assert not s.start(b)  # taken by a free device, not ahead
    assert s.preempt(b, 0.002) is None  # it runs: only a batch taken ahead is swapped out
    assert (s.queued("hi"), s.queued("mid"), s.queued("lo")) == (1, 0, 0)


def test_a_lane_config_converts_to_the_schedulers_own_settings() -> None:
    from worker.core.lane_settings import LaneSettings, LaneSpec

    cfg = LaneConfig(name="hi", topics=["t"], weight=3.0, priority=7, max_batch_size=5, max_wait_ms=2.5,
                     deadline_ms=100.0, queue_bound=9, fill_with_lower=True)
    settings = cfg.settings()
    spec_fields = [n for n in vars(LaneSpec) if not n.startswith("_")]
    # nothing read is left unconverted
    assert sorted(spec_fields) == sorted(LaneSettings.__dataclass_fields__)
    assert all(getattr(settings, n) == getattr(cfg, n) for n in spec_fields)
    # The scheduler takes either, and behaves the same with both.
    a = PriorityScheduler([cfg, LaneConfig(name="lo")], "lo")
    b = PriorityScheduler([settings, LaneSettings(name="lo")], "lo")
    for s in (a, b):
        feed(s, [rec("hi", offset=i) for i in range(5)], now=0.0)
    batch_a, batch_b = a.next_batch(0.0), b.next_batch(0.0)
    assert batch_a is not None and batch_b is not None
    assert ids(batch_a.records) == ids(batch_b.records) and a.stats() == b.stats()
    with pytest.raises(ValueError, match="lane 'x': weight must be > 0"):
        LaneSettings(name="x", weight=0.0)
