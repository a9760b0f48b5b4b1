"""Token budgets (lane option ``max_batch_tokens``): the batcher's windows, a lane's ready batches, and the
scheduler's fill, top-up and preemption paths keep every batch within its lane's budget."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.support.props import examples
from tests.unit.batching_ops import BatcherPlay, SchedulerPlay
from tests.unit.batching_ops import batch_cost as _cost
from tests.unit.fakes import ids, lanes, rec
from worker.core.batcher import MicroBatcher, fitting
from worker.core.lane_settings import LaneSettings
from worker.core.records import Batch
from worker.core.scheduler import PriorityScheduler


def test_window_closes_before_the_record_that_does_not_fit() -> None:
    b = MicroBatcher("L", max_batch_size=10, max_wait_s=1.0, max_batch_tokens=10)
    a, c, d = rec(size=4), rec(size=5), rec(size=3)
    assert b.add(a, 0.0) == [] and b.add(c, 0.1) == []
    (x,) = b.add(d, 0.2)  # 4 + 5 + 3 > 10: the window closes without d, which opens the next one
    assert x.reason == "tokens" and x.records == [a, c] and x.closed_at == 0.2 and x.opened_at == 0.0
    assert len(b) == 1 and b.next_deadline() == pytest.approx(1.2)  # d's window opened at its arrival


def test_window_that_reaches_the_budget_closes_at_once() -> None:
    b = MicroBatcher("L", 10, 1.0, max_batch_tokens=8)
    assert b.add(rec(size=3), 0.0) == []
    (x,) = b.add(rec(size=5), 0.0)
    assert x.reason == "tokens" and _cost(x) == 8 and len(b) == 0


def test_record_over_the_budget_runs_alone() -> None:
    b = MicroBatcher("L", 10, 1.0, max_batch_tokens=8)
    small, big = rec(size=2), rec(size=30)
    b.add(small, 0.0)
    out = b.add(big, 0.1)
    assert [x.records for x in out] == [[small], [big]]
    assert [x.reason for x in out] == ["tokens", "tokens"] and len(b) == 0


def test_count_still_closes_first_when_it_comes_first() -> None:
    b = MicroBatcher("L", 3, 1.0, max_batch_tokens=100)
    out = [x for r in [rec(size=2) for _ in range(4)] for x in b.add(r, 0.0)]
    assert [(len(x), x.reason) for x in out] == [(3, "count")] and len(b) == 1


def test_model_without_size_of_makes_the_budget_a_count() -> None:
    b = MicroBatcher("L", 100, 1.0, max_batch_tokens=4)  # size 1 (and 0: at least 1) per record
    out = [x for s in (1, 0, 1, 1, 1) for x in b.add(rec(size=s), 0.0)]
    assert [len(x) for x in out] == [4] and len(b) == 1


def test_take_open_within_the_budget_and_within_a_fill_room() -> None:
    b = MicroBatcher("L", 10, 1.0, max_batch_tokens=9)
    rs = [rec(size=s) for s in (4, 4)]
    for r in rs:
        b.add(r, 0.0)
    assert b.take_open(0.1, 10, tokens=3) is None  # a fill with room for 3: the first record does not fit
    x = b.take_open(0.1, 10, tokens=5)
    assert x is not None and x.records == rs[:1]
    x = b.take_open(0.2, 10)
    assert x is not None and x.records == rs[1:] and len(b) == 0


def test_lowering_the_budget_splits_open_windows() -> None:
    b = MicroBatcher("L", 20, 1.0)
    rs = [rec(size=s) for s in (3, 3, 3, 3, 1)]
    for r in rs:
        b.add(r, 0.0)
    b.set_max_batch_tokens(6)
    assert b.max_batch_tokens == 6 and b.next_deadline() == 0.0  # due now
    out = b.poll(0.1)
    assert [ids(x.records) for x in out] == [ids(rs[:2]), ids(rs[2:4])]
    assert len(b) == 1 and b.next_deadline() == 1.0  # the remainder keeps its window's age
    assert [len(x) for x in b.flush(0.2)] == [1]
    b.set_max_batch_tokens(None)  # no budget any more: a count again
    for r in rs:
        assert b.add(r, 0.3) == []


def test_fitting() -> None:
    rs = [rec(size=s) for s in (5, 2, 2)]
    assert fitting(rs, 10, None) == 3 and fitting(rs, 2, None) == 2
    assert fitting(rs, 10, 7) == 2 and fitting(rs, 10, 4) == 1  # alone, over the budget
    assert fitting(rs, 10, 4, lone=False) == 0


@pytest.mark.parametrize("bad", [0, -3])
def test_rejects_a_budget_below_one(bad: int) -> None:
    with pytest.raises(ValueError, match="max_batch_tokens"):
        MicroBatcher("L", 4, 0.01, max_batch_tokens=bad)
    with pytest.raises(ValueError, match="max_batch_tokens"):
        LaneSettings(name="x", max_batch_tokens=bad)


def test_ready_batches_are_cut_to_a_lowered_budget_at_dispatch() -> None:
    s = PriorityScheduler(lanes({"name": "default", "max_batch_size": 10, "max_wait_ms": 0,
                                 "max_batch_tokens": 100}), "default")
    rs = [rec(size=10) for _ in range(6)]
    for r in rs:
        s.add(r, 0.0)
    s.set_max_batch_tokens("default", 25)
    assert s.max_batch_tokens("default") == 25 and s.stats()["default"]["max_batch_tokens"] == 25
    got = [s.next_batch(0.0) for _ in range(3)]
    assert [ids(x.records) for x in got if x is not None] == [ids(rs[:2]), ids(rs[2:4]), ids(rs[4:])]


def test_fill_with_lower_stops_at_the_budget() -> None:
    s = PriorityScheduler(lanes({"name": "hi", "priority": 5, "max_batch_size": 8, "max_wait_ms": 0,
                                 "max_batch_tokens": 10, "fill_with_lower": True},
                                {"name": "lo", "max_batch_size": 8, "max_wait_ms": 50}), "lo")
    h = rec("hi", size=4)
    lo = [rec("lo", size=s) for s in (3, 2, 2, 1)]
    for r in lo:
        s.add(r, 0.0)
    s.add(h, 0.0)
    b = s.next_batch(0.0)
    assert b is not None and b.lane == "hi" and b.mixed
    assert b.records == [h, lo[0], lo[1]]  # 4 + 3 + 2; the last (1) would fit but may not overtake
    assert _cost(b) <= 10


def test_full_by_tokens_is_taken_ahead() -> None:
    s = PriorityScheduler(lanes({"name": "default", "max_batch_size": 32, "max_wait_ms": 50,
                                 "max_batch_tokens": 10}), "default")
    for size in (6, 6):
        s.add(rec(size=size), 0.0)  # the second closes the first window by tokens
    b = s.next_batch(0.0, idle=False, full_only=True)
    assert b is not None and [r.size for r in b.records] == [6]


# ---------------------------------------------------------------- properties

_ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 14), st.floats(0, 0.02)),
        st.tuples(st.just("poll"), st.just(0), st.floats(0, 0.05)),
        st.tuples(st.just("take"), st.integers(1, 9), st.floats(0, 0.01)),
        st.tuples(st.just("fill"), st.integers(1, 12), st.just(0.0)),
        st.tuples(st.just("max"), st.integers(1, 9), st.just(0.0)),
        st.tuples(st.just("tokens"), st.integers(0, 20), st.just(0.0)),
        st.tuples(st.just("remove"), st.integers(0, 3), st.just(0.0)),
    ),
    max_size=120,
)


@settings(max_examples=examples(250), deadline=None)
@given(ops=_ops, max_batch=st.integers(1, 8), max_wait=st.sampled_from([0.0, 0.005, 0.02]),
       bucket=st.sampled_from([0, 5]), budget=st.integers(1, 20))
@example(ops=[("add", 3, 0.0), ("add", 3, 0.0), ("tokens", 4, 0.0), ("add", 1, 0.0)], max_batch=8,
         max_wait=0.02, bucket=0, budget=10)
def test_batcher_every_record_once_within_budget(ops: list[tuple[str, int, float]], max_batch: int,
                                                 max_wait: float, bucket: int, budget: int) -> None:
    b = MicroBatcher("L", max_batch, max_wait, bucket_width=bucket, max_batch_tokens=budget)

    def check(x: Batch, op: str, arg: int) -> None:
        tok = b.max_batch_tokens
        if op == "fill":  # within the fill's room of ``arg`` tokens
            assert _cost(x) <= (arg if tok is None else min(arg, tok)), "over the fill room"
        elif tok is not None:
            assert _cost(x) <= tok or len(x) == 1, "over the budget, not alone"

    play = BatcherPlay(b, bucket, check)
    for op, arg, dt in ops:
        play.apply(op, arg, dt)
    play.finish()


_add = st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 12), st.sampled_from([None, 0.01, 0.05]))
_sched_ops = st.lists(st.one_of(
    _add, _add, _add,
    st.tuples(st.just("next"), st.booleans(), st.just(0), st.just(None)),
    st.tuples(st.just("tick"), st.integers(1, 20), st.just(0), st.just(None)),
    st.tuples(st.just("expire"), st.just(0), st.just(0), st.just(None)),
    st.tuples(st.just("revoke"), st.integers(0, 3), st.just(0), st.just(None)),
    st.tuples(st.just("max"), st.integers(0, 2), st.integers(1, 6), st.just(None)),
    st.tuples(st.just("tokens"), st.integers(0, 2), st.integers(0, 16), st.just(None)),
    st.tuples(st.just("observe"), st.integers(0, 2), st.integers(1, 6), st.just(None)),
    st.tuples(st.just("flush"), st.just(0), st.just(0), st.just(None)),
    st.tuples(st.just("ahead"), st.just(0), st.just(0), st.just(None)),
    st.tuples(st.just("start"), st.just(0), st.just(0), st.just(None)),
), min_size=10, max_size=80)


@settings(max_examples=examples(200), deadline=None)
@given(ops=_sched_ops, policy=st.sampled_from(["fixed", "adaptive"]), bucket=st.sampled_from([0, 4]),
       budgets=st.tuples(st.sampled_from([None, 6, 12]), st.sampled_from([None, 5, 9]),
                         st.sampled_from([None, 10])),
       fill=st.booleans(), trained=st.booleans())
def test_scheduler_every_record_once_no_batch_over_its_budget(
        ops: list[tuple[str, object, int, float | None]], policy: str, bucket: int,
        budgets: tuple[int | None, int | None, int | None], fill: bool, trained: bool) -> None:
    cfg = lanes({"name": "hi", "priority": 5, "weight": 2, "max_batch_size": 4, "max_wait_ms": 5,
                 "fill_with_lower": fill, "max_batch_tokens": budgets[0]},
                {"name": "lo", "priority": 1, "max_batch_size": 3, "max_wait_ms": 0,
                 "fill_with_lower": fill, "max_batch_tokens": budgets[1]},
                {"name": "default", "max_batch_size": 5, "max_wait_ms": 20, "max_batch_tokens": budgets[2]})
    s = PriorityScheduler(cfg, "default", policy, bucket_width=bucket)
    if trained:  # a trained latency model, so the adaptive paths (hold, expire early) run
        for n in (1, 3, 5):
            s.observe("default", n, 0.002 + 0.001 * n)

    def check(b: Batch, taken_ahead: Batch | None) -> None:
        # (a batch taken ahead before its lane's budget was lowered keeps its cost; the engine splits it)
        tok = s.max_batch_tokens(b.lane)
        ok_t = _cost(taken_ahead) if taken_ahead is not None else 0
        if tok is not None:
            assert _cost(b) <= max(tok, ok_t) or len(b) == 1, "over its lane's budget, not alone"

    play = SchedulerPlay(s, bucket, check)
    for op, a1, a2, a3 in ops:
        play.apply(op, a1, a2, a3)
    play.finish()
