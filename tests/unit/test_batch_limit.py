"""worker/core/batch_limit.py: the per-lane batch limit after out-of-memory errors, as a state machine.

The properties hold for any sequence of successes, out-of-memory errors, snapshots and restores: the
limit stays within [1, ceiling], a size that ran out of memory is never the limit, patience stays within
[grow_after, grow_after * MAX_BACKOFF], and successes alone always lift the limit again. ``Reference`` is
the engine's earlier per-lane dict code for one lane; the machine checks every transition against it.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule

from tests.support.props import examples
from worker.core.batch_limit import MAX_BACKOFF, BatchLimit, LimitChange, LimitPolicy, LimitState


class Reference:
    """One lane of the engine's limit code as it was kept in parallel dicts (None = key absent)."""

    def __init__(self, grow_after: int, grow_factor: float, configured: int | None) -> None:
        self.grow_after, self.grow_factor, self.configured = grow_after, grow_factor, configured
        self.limit: int | None = None
        self.ceiling: int | None = configured
        self.streak: int | None = None
        self.patience: int | None = None
        self.probing: bool | None = None
        self.good = 0
        self.notified: list[int] = []

    def seen(self, n: int) -> None:
        if self.configured is None and n > (self.ceiling or 0):
            self.ceiling = n

    def success(self, n: int) -> None:
        self.seen(n)
        if n > self.good:
            self.good = n
        if self.limit is None:
            return
        self.streak = (self.streak or 0) + 1
        if self.streak < (self.patience or self.grow_after):
            return
        self.set_limit(max(self.limit + 1, int(self.limit * self.grow_factor)), grow=True)

    def set_limit(self, new: int, grow: bool) -> None:
        old = self.limit
        ceiling = self.ceiling if self.ceiling is not None else new
        self.streak = 0
        if grow and old is None:
            return
        if not grow and old is not None and new >= old:
            return
        if grow and new >= ceiling:
            self.limit = None
            self.probing = True
            new = ceiling
        else:
            self.limit = new
            self.probing = grow
        self.notified.append(new)

    def oom(self, n: int) -> None:
        self.seen(n)
        good = self.good
        if good >= n:
            good = self.good = 0
        if self.probing:
            self.patience = min((self.patience or self.grow_after) * 2, self.grow_after * 64)
        self.probing = None
        self.set_limit(max(1, n // 2, good), grow=False)

    def state(self) -> tuple[Any, ...]:
        return (self.limit, self.patience, self.probing, self.good, self.streak)

    def restore(self, state: tuple[Any, ...]) -> None:
        old = self.limit
        self.limit, self.patience, self.probing, good, self.streak = state
        self.good = max(good, self.good)
        if old == self.limit:
            return
        new = self.limit if self.limit is not None else self.ceiling
        if new is not None:
            self.notified.append(new)


class LimitMachine(RuleBasedStateMachine):
    snapshots = Bundle("snapshots")

    @initialize(grow_after=st.integers(1, 4), grow_factor=st.sampled_from([1.0, 1.25, 2.0]),
                configured=st.one_of(st.none(), st.integers(1, 48)),
                cap=st.one_of(st.none(), st.integers(1, 48)))
    def setup(self, grow_after: int, grow_factor: float, configured: int | None, cap: int | None) -> None:
        self.policy = LimitPolicy(grow_after=grow_after, grow_factor=grow_factor)
        self.lim = BatchLimit(self.policy, configured)
        self.ref = Reference(grow_after, grow_factor, configured)
        self.notified: list[int] = []
        self.largest = 0
        if cap is not None:  # the model's own max batch, at setup
            self.note(self.lim.cap(cap))
            if configured is not None:  # (the engine capped configured lanes only)
                self.ref.ceiling = min(configured, cap)
                if configured > cap:
                    self.ref.set_limit(cap, grow=False)

    def note(self, change: LimitChange | None) -> None:
        if change is not None and change.after is not None:
            self.notified.append(change.after)

    def sizes(self, data: st.DataObject, low: int) -> int:
        top = self.lim.ceiling or 48  # batches never exceed the lane's max (the scheduler cuts them)
        return data.draw(st.integers(min(low, top), top))

    @rule(data=st.data())
    def success(self, data: st.DataObject) -> None:
        n = self.sizes(data, 1)
        before = copy.copy(self.lim)
        self.note(self.lim.succeeded(n))
        self.ref.success(n)
        self.largest = max(self.largest, n)
        if before.limit is None:
            assert self.lim.limit is None
        elif before.streak + 1 < before.patience:
            assert self.lim.limit == before.limit and self.lim.streak == before.streak + 1
        else:
            step = max(before.limit + 1, int(before.limit * self.policy.grow_factor))
            assert self.lim.limit == (None if step >= (self.lim.ceiling or step) else step)
            assert self.lim.probing and self.lim.streak == 0

    @precondition(lambda self: (self.lim.ceiling or 48) >= 2)
    @rule(data=st.data())
    def out_of_memory(self, data: st.DataObject) -> None:
        n = self.sizes(data, 2)  # (a record alone is retried, not split: the limit is not lowered)
        before = copy.copy(self.lim)
        self.note(self.lim.out_of_memory(n))
        self.ref.oom(n)
        self.largest = max(self.largest, n)
        # A size that ran out of memory is not the limit (it would be retried as it is).
        assert self.lim.limit is not None and self.lim.limit < n
        if before.limit is not None:
            assert self.lim.limit <= before.limit  # never raised by an out-of-memory error
        if before.probing:
            assert self.lim.patience == min(before.patience * 2, self.policy.grow_after * MAX_BACKOFF)

    @rule(target=snapshots)
    def snapshot(self) -> tuple[LimitState, tuple[Any, ...]]:
        return self.lim.snapshot(), self.ref.state()

    @rule(snap=snapshots)
    def restore(self, snap: tuple[LimitState, tuple[Any, ...]]) -> None:
        state, ref_state = snap
        good = self.lim.good
        self.note(self.lim.restore(state))
        self.ref.restore(ref_state)
        assert self.lim.limit == state.limit and self.lim.patience == state.patience
        assert self.lim.good == max(good, state.good)

    @invariant()
    def agrees_with_the_reference(self) -> None:
        lim, ref = self.lim, self.ref
        assert lim.limit == ref.limit and lim.ceiling == ref.ceiling and lim.good == ref.good
        assert lim.patience == (ref.patience or self.policy.grow_after)
        assert lim.probing == bool(ref.probing) and lim.streak == (ref.streak or 0)
        assert self.notified == ref.notified

    @invariant()
    def limit_within_one_and_the_ceiling(self) -> None:
        lim = self.lim
        if lim.limit is not None:
            assert lim.ceiling is not None and 1 <= lim.limit <= lim.ceiling
        if lim.configured is not None:
            assert lim.ceiling is not None and lim.ceiling <= lim.configured

    @invariant()
    def patience_and_streak_bounded(self) -> None:
        lim, g = self.lim, self.policy.grow_after
        assert g <= lim.patience <= g * MAX_BACKOFF
        assert 0 <= lim.streak < lim.patience
        assert 0 <= lim.good <= max(self.largest, 0)

    @rule()
    def successes_alone_lift_the_limit(self) -> None:
        lim = copy.copy(self.lim)
        if lim.limit is None:
            return
        ceiling = lim.ceiling
        assert ceiling is not None
        last, changes = lim.limit, 0
        for _ in range(ceiling * self.policy.grow_after * MAX_BACKOFF):
            change = lim.succeeded(1)
            if change is not None:
                changes += 1
                assert change.after is not None
                assert change.after > last or (change.lifted and change.after == last)  # it only climbs
                last = change.after
            if lim.limit is None:
                assert last == ceiling and change is not None and change.lifted
                return
        raise AssertionError(f"still limited to {lim.limit} after {changes} steps up: {lim!r}")


LimitMachine.TestCase.settings = settings(max_examples=examples(150), stateful_step_count=40, deadline=None)
TestLimitMachine = LimitMachine.TestCase


@settings(max_examples=examples(100), deadline=None)
@given(configured=st.integers(1, 64), extra=st.integers(1, 200))
@example(configured=4, extra=6)  # the dict code set the limit to 5, above the lane's max of 4
def test_a_batch_over_the_configured_max_never_lifts_the_limit_above_it(configured: int, extra: int) -> None:
    lim = BatchLimit(LimitPolicy(grow_after=1), configured)
    lim.out_of_memory(configured + extra)
    assert lim.limit is not None and lim.limit <= configured


def test_an_oom_goes_back_to_the_largest_size_known_to_fit_else_half() -> None:
    lim = BatchLimit(LimitPolicy(grow_after=2), 64)
    lim.succeeded(40)
    assert lim.out_of_memory(64) == LimitChange(before=64, after=40, lifted=False)
    assert lim.out_of_memory(40) == LimitChange(before=40, after=20, lifted=False)  # 40 no longer fits
    assert lim.out_of_memory(48) is None  # a concurrent recovery lowered it further (24 > 20) already
    assert lim.limit == 20


def test_the_limit_climbs_by_the_factor_at_least_one_and_a_failed_step_doubles_the_wait() -> None:
    lim = BatchLimit(LimitPolicy(grow_after=2, grow_factor=1.25), 8)
    lim.out_of_memory(2)
    assert lim.limit == 1
    steps = []
    for _ in range(40):
        change = lim.succeeded(1)
        if change is not None:
            steps.append(change.after)
    assert steps == [2, 3, 4, 5, 6, 7, 8] and lim.limit is None  # +1 each until x1.25 says more; lifted at 8
    assert lim.probing
    lim.out_of_memory(8)  # the lift was a step up too
    assert lim.patience == 4 and lim.limit == 4


def test_a_capped_model_limits_every_configured_lane_for_good() -> None:
    lim = BatchLimit(LimitPolicy(grow_after=1), 32)
    assert lim.cap(1) == LimitChange(before=1, after=1, lifted=False)
    assert lim.limit == 1 and lim.ceiling == 1
    assert lim.succeeded(1) == LimitChange(before=1, after=1, lifted=True)  # lifted to the cap, not to 32
    assert lim.ceiling == 1 and BatchLimit(LimitPolicy(), 4).cap(8) is None
    unconfigured = BatchLimit(LimitPolicy())
    assert unconfigured.cap(1) is None and unconfigured.ceiling is None


def test_a_lane_without_a_configured_max_is_lifted_to_the_largest_batch_seen() -> None:
    lim = BatchLimit(LimitPolicy(grow_after=1, grow_factor=2.0))
    lim.succeeded(10)
    lim.out_of_memory(24)
    assert lim.ceiling == 24 and lim.limit == 12
    assert lim.succeeded(5) == LimitChange(before=12, after=24, lifted=True)


def test_restore_puts_the_limit_back_and_keeps_what_ran() -> None:
    lim = BatchLimit(LimitPolicy(grow_after=3), 16)
    before = lim.snapshot()
    lim.out_of_memory(16)
    lim.succeeded(8)
    assert lim.restore(before) == LimitChange(before=8, after=16, lifted=True)
    assert lim.limit is None and lim.good == 8 and lim.restore(before) is None


@pytest.mark.parametrize(("kw", "match"), [({"grow_after": 0}, "grow_after"),
                                           ({"grow_factor": 0.5}, "grow_factor")])
def test_a_bad_policy_is_refused_naming_the_field(kw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LimitPolicy(**kw)


def test_sizes_below_one_are_refused() -> None:
    with pytest.raises(ValueError, match="configured"):
        BatchLimit(LimitPolicy(), 0)
    with pytest.raises(ValueError, match="cap"):
        BatchLimit(LimitPolicy(), 4).cap(0)
    with pytest.raises(ValueError, match=">= 1"):
        BatchLimit(LimitPolicy(), 4).lower(0)
