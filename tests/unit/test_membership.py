"""RejoinWatch (worker/core/membership.py): when a consumer out of its group is given up on."""

from __future__ import annotations

import pytest

from worker.core.membership import MAX_BACKOFF, RejoinWatch


def test_due_only_after_the_allowance_out_of_the_group() -> None:
    w = RejoinWatch(10.0)
    assert not w.due(1e9)  # in the group until told otherwise
    w.out(100.0)
    assert not w.due(109.9) and w.due(110.0)
    assert w.out_for(104.0) == 4.0


def test_out_again_keeps_the_earlier_start() -> None:
    w = RejoinWatch(10.0)
    w.out(100.0)
    w.out(105.0)  # e.g. a loss after subscribing, before the first assignment
    assert w.due(110.0)


def test_an_assignment_ends_it() -> None:
    w = RejoinWatch(10.0)
    w.out(100.0)
    w.joined()
    assert not w.due(1e9) and w.out_for(1e9) == 0.0


def test_each_replacement_without_a_join_doubles_the_allowance_up_to_the_cap_and_a_join_resets_it() -> None:
    w = RejoinWatch(10.0)
    w.out(0.0)
    now = 0.0
    waits = []
    for _ in range(6):
        start = now
        while not w.due(now):
            now += 1.0
        waits.append(now - start)
        w.replaced(now)
    assert waits == [10.0, 20.0, 40.0, 80.0, 80.0, 80.0] and MAX_BACKOFF * 10.0 == 80.0
    assert w.replacements == 6
    w.joined()
    w.out(now)
    assert w.due(now + 10.0) and w.replacements == 0


def test_zero_never_replaces_and_negative_is_refused() -> None:
    w = RejoinWatch(0.0)
    w.out(0.0)
    assert not w.due(1e12)
    with pytest.raises(ValueError, match="timeout_s"):
        RejoinWatch(-1.0)
