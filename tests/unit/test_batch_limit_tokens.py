"""worker/core/batch_limit.py: the token budget held beside the count after out-of-memory errors.

For any sequence of successes, out-of-memory errors, snapshots and restores: the token limit stays within
[1, its ceiling], a cost that ran out of memory is never the budget in force after it, every change of the
budget in force is reported (and nothing else is reported as one), successes alone lift both limits, and
a caller that passes no costs sees the count-only machine."""

from __future__ import annotations

from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.support.props import examples
from worker.core.batch_limit import BatchLimit, LimitChange, LimitPolicy

_op = st.one_of(
    st.tuples(st.just("ok"), st.integers(1, 40), st.integers(1, 600)),
    st.tuples(st.just("oom"), st.integers(1, 40), st.integers(1, 600)),
    st.tuples(st.just("snap"), st.just(0), st.just(0)),
    st.tuples(st.just("restore"), st.just(0), st.just(0)),
)


def test_an_oom_halves_the_token_budget_and_successes_bring_it_back() -> None:
    lim = BatchLimit(LimitPolicy(grow_after=2, grow_factor=2.0), configured=32, configured_tokens=1000)
    change = lim.out_of_memory(8, tokens=800)
    assert change is not None and change.tokens_before == 1000 and change.tokens_after == 400
    assert lim.tokens == 400 and lim.limit == 4
    assert lim.succeeded(4, tokens=400) is None
    change = lim.succeeded(4, tokens=400)  # second success in a row: one step up for both
    assert change is not None and (change.after, change.tokens_after) == (8, 800)
    for _ in range(4):
        lim.succeeded(8, tokens=800)
    assert lim.limit is None and lim.tokens_limit is None and lim.tokens == 1000


def test_a_lane_without_a_budget_gets_one_after_an_oom_and_loses_it_when_lifted() -> None:
    lim = BatchLimit(LimitPolicy(grow_after=1, grow_factor=4.0), configured=32)
    lim.succeeded(16, tokens=300)
    change = lim.out_of_memory(16, tokens=1200)
    assert change is not None and change.tokens_before is None and change.tokens_after == 600
    assert change.tokens_changed
    while lim.limit is not None or lim.tokens_limit is not None:
        lim.succeeded(4, tokens=100)
    assert lim.tokens is None  # lifted: no budget again, as configured


def test_only_the_token_budget_changes_when_the_count_is_already_lower() -> None:
    lim = BatchLimit(LimitPolicy(grow_after=100), configured=32, configured_tokens=4096)
    lim.out_of_memory(4, tokens=4000)  # count 2, tokens 2000
    change = lim.out_of_memory(2, tokens=2000)  # count stays 1..2, tokens 1000
    assert change is not None and change.tokens_after == 1000 and lim.limit == 1


@settings(max_examples=examples(300), deadline=None)
@given(ops=st.lists(_op, max_size=80), configured=st.integers(1, 32),
       configured_tokens=st.one_of(st.none(), st.integers(1, 512)), grow_after=st.integers(1, 4),
       factor=st.sampled_from([1.0, 1.25, 2.0]))
@example(ops=[("oom", 1, 1), ("restore", 0, 0), ("snap", 0, 0)], configured=1, configured_tokens=None,
         grow_after=1, factor=1.0)
def test_token_limit_properties(ops: list[tuple[str, int, int]], configured: int,
                                configured_tokens: int | None, grow_after: int, factor: float) -> None:
    policy = LimitPolicy(grow_after=grow_after, grow_factor=factor)
    lim = BatchLimit(policy, configured, configured_tokens)
    plain = BatchLimit(policy, configured)  # the same sizes, no costs: the count-only machine
    snap, plain_snap = lim.snapshot(), plain.snapshot()
    for op, n, t in ops:
        before = lim.tokens
        change: LimitChange | None = None
        if op == "ok":
            change = lim.succeeded(n, tokens=t)
            plain.succeeded(n)
        elif op == "oom":
            change = lim.out_of_memory(n, tokens=t)
            plain.out_of_memory(n)
            if t > 1:
                assert lim.tokens is not None and lim.tokens < t, "a cost that ran out of memory is in force"
        elif op == "snap":
            snap, plain_snap = lim.snapshot(), plain.snapshot()
        else:
            change = lim.restore(snap)
            plain.restore(plain_snap)
            assert lim.tokens_limit == (None if snap.tokens_limit is None
                                        else min(snap.tokens_limit, lim.tokens_ceiling or snap.tokens_limit))
        assert lim.limit == plain.limit, "costs changed the count's limit"
        if lim.tokens_limit is not None:
            assert lim.tokens_ceiling is not None and 1 <= lim.tokens_limit <= lim.tokens_ceiling
        if configured_tokens is not None and lim.tokens is not None:
            assert lim.tokens <= configured_tokens
        if lim.tokens != before:
            assert change is not None and change.tokens_before == before and change.tokens_after == lim.tokens
        elif change is not None:
            assert not change.tokens_changed
        if lim.tokens_limit is None:
            assert lim.tokens == configured_tokens
    for _ in range(10_000):  # successes alone lift both limits
        if lim.limit is None and lim.tokens_limit is None:
            break
        lim.succeeded(1, tokens=1)
    assert lim.limit is None and lim.tokens_limit is None and lim.tokens == configured_tokens
