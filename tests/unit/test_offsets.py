from __future__ import annotations

import copy
import time

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tests.support.props import examples
from worker.core.offsets import OffsetTracker
from worker.core.records import TopicPartition

A = TopicPartition("in", 0)
B = TopicPartition("in", 1)


def test_commits_only_the_contiguous_done_prefix() -> None:
    t = OffsetTracker()
    for o in range(5):
        t.track(A, o)
    assert t.committable() == {}
    t.ack(A, 1)
    t.ack(A, 2)
    assert t.committable() == {}  # 0 still in flight
    t.ack(A, 0)
    assert t.committable() == {A: 3}
    t.ack(A, 4)
    assert t.committable() == {A: 3}
    t.ack(A, 3)
    assert t.committable() == {A: 5}
    assert t.in_flight() == 0 and t.pending(A) == 0


def test_gaps_between_tracked_offsets_are_not_holes() -> None:
    t = OffsetTracker()
    for o in (10, 11, 15, 20):  # 12-14, 16-19: compacted away or transaction markers
        t.track(A, o)
    t.ack(A, 10)
    t.ack(A, 11)
    assert t.committable() == {A: 15}  # next to consume; commit does not claim 15 is done
    t.ack(A, 15)
    assert t.committable() == {A: 20}
    t.ack(A, 20)
    assert t.committable() == {A: 21}


def test_only_advanced_partitions_are_committable() -> None:
    t = OffsetTracker()
    t.track(A, 0)
    t.track(B, 0)
    t.track(B, 1)
    t.ack(A, 0)
    t.ack(B, 0)
    assert t.committable() == {A: 1, B: 1}
    t.mark_committed({A: 1, B: 1})
    assert t.committable() == {}
    t.ack(B, 1)
    assert t.committable() == {B: 2}
    assert t.committed(A) == 1


def test_commit_not_marked_is_offered_again() -> None:
    t = OffsetTracker()
    t.track(A, 0)
    t.ack(A, 0)
    assert t.committable() == {A: 1}
    assert t.committable() == {A: 1}  # the commit failed: still offered
    t.mark_committed({A: 1})
    t.mark_committed({A: 0})  # an older, late success never moves it back
    assert t.committed(A) == 1 and t.committable() == {}


def test_unknown_acks_and_redeliveries_are_ignored() -> None:
    t = OffsetTracker()
    assert t.ack(A, 7) is False
    assert t.track(A, 5) is True
    assert t.track(A, 5) is False and t.track(A, 3) is False  # not after the last tracked: ignored
    assert t.in_flight() == 1
    assert t.ack(A, 5) is True and t.ack(A, 5) is False
    assert t.committable() == {A: 6}


def test_revoke_drops_partitions_and_in_flight() -> None:
    t = OffsetTracker()
    for o in range(3):
        t.track(A, o)
        t.track(B, o)
    t.ack(A, 0)
    t.revoke({A})
    assert t.in_flight() == 3 and t.pending(A) == 0
    assert t.ack(A, 1) is False
    assert A not in t.committable()
    t.track(A, 1)  # reassigned later: a fresh start from the committed position
    t.ack(A, 1)
    assert t.committable() == {A: 2}


def test_a_detached_partition_keeps_what_was_delivered_and_takes_late_acks() -> None:
    t = OffsetTracker()
    for o in range(10, 16):
        t.track(A, o)
    t.track(B, 0)
    t.ack(A, 10)
    t.ack(A, 11)
    t.ack(A, 13)  # 12 in flight
    t.detach([A])
    assert t.in_flight() == 1 and t.committable() == {} and t.lost() == [A]  # only B's record is live
    assert not t.ack(A, 12)  # the live path knows nothing of it any more
    assert t.ack_lost(A, 12)  # a result delivered after the loss
    assert not t.ack_lost(A, 12) and not t.ack_lost(B, 0)
    t.ack_lost(A, 15)  # beyond 14, which never finishes (dropped at the loss)
    assert t.in_flight() == 1
    assert t.take_lost(A) == (10, 14)  # [10, 14) delivered; 14 blocks
    assert t.take_lost(A) is None and t.lost() == []  # taken once


def test_take_lost_is_none_when_nothing_was_delivered_or_nothing_kept() -> None:
    t = OffsetTracker()
    t.track(A, 5)
    t.track(A, 6)
    t.ack(A, 6)  # 5 blocks the prefix
    t.detach([A, B])  # B was never tracked: nothing kept for it
    assert t.lost() == [A]
    assert t.take_lost(A) is None and t.take_lost(B) is None
    t.track(B, 0)
    t.ack(B, 0)
    t.detach([B])
    t.forget_lost()
    assert t.lost() == [] and t.take_lost(B) is None


def test_a_partition_back_after_a_loss_is_tracked_afresh_and_a_new_loss_replaces_the_old() -> None:
    t = OffsetTracker()
    t.track(A, 0)
    t.ack(A, 0)
    t.detach([A])
    t.track(A, 1)  # assigned again: a new assignment's state, whatever was kept
    assert t.in_flight() == 1 and t.committable() == {}
    t.ack(A, 1)
    assert t.committable() == {A: 2}
    t.track(A, 2)
    t.detach([A])
    assert t.take_lost(A) == (1, 2)  # the second loss's span: first offset 1, record 2 not done


def test_assign_resets_state() -> None:
    t = OffsetTracker()
    t.track(A, 0)
    t.assign([A, B])
    assert t.in_flight() == 0 and set(t.partitions()) == {A, B}
    assert t.committable() == {}


def test_ack_is_cheap_per_record() -> None:
    # Not a timed assert of speed: a guard against an accidental O(n) per ack (which would take minutes).
    t = OffsetTracker()
    n = 200_000
    for o in range(n):
        t.track(A, o)
    t0 = time.perf_counter()
    for o in range(n - 1, -1, -1):  # worst order: everything waits for offset 0
        t.ack(A, o)
    assert time.perf_counter() - t0 < 10.0
    assert t.committable() == {A: n}


# ---------------------------------------------------------------- property: a random model of delivery


class TrackerMachine(RuleBasedStateMachine):
    """Random interleavings of receive / deliver / fail / commit on two partitions with gaps."""

    def __init__(self) -> None:
        super().__init__()
        self.t = OffsetTracker()
        self.next_off = {A: 0, B: 0}
        self.tracked: dict[TopicPartition, list[int]] = {A: [], B: []}
        self.done: dict[TopicPartition, set[int]] = {A: set(), B: set()}
        self.committed: dict[TopicPartition, int] = {}
        self.last_offered: dict[TopicPartition, int] = {}

    @rule(tp=st.sampled_from([A, B]), gap=st.integers(0, 3))
    def receive(self, tp: TopicPartition, gap: int) -> None:
        off = self.next_off[tp] + gap
        assert self.t.track(tp, off)
        self.tracked[tp].append(off)
        self.next_off[tp] = off + 1

    def _not_done(self) -> list[tuple[TopicPartition, int]]:
        return [(tp, o) for tp in (A, B) for o in self.tracked[tp] if o not in self.done[tp]]

    @precondition(lambda self: bool(self._not_done()))
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        tp, off = data.draw(st.sampled_from(self._not_done()))
        assert self.t.ack(tp, off)
        self.done[tp].add(off)

    @rule(succeed=st.booleans())
    def commit(self, succeed: bool) -> None:
        offered = self.t.committable()
        for tp in (A, B):
            tracked = self.tracked[tp]
            if not tracked:
                assert tp not in offered
                continue
            blocking = [o for o in tracked if o not in self.done[tp]]
            expect = blocking[0] if blocking else tracked[-1] + 1  # after the whole done prefix
            should_offer = expect > tracked[0] and expect > self.committed.get(tp, -1)
            assert (tp in offered) == should_offer
            if should_offer:
                pos = offered[tp]
                assert pos == expect
                assert all(o in self.done[tp] for o in tracked if o < pos)  # never past a record not done
                assert pos >= self.last_offered.get(tp, pos)  # never backwards
                self.last_offered[tp] = pos
        if succeed and offered:
            self.t.mark_committed(offered)
            self.committed.update(offered)

    @invariant()
    def counts_match(self) -> None:
        nd = self._not_done()
        assert self.t.in_flight() == len(nd)
        for tp in (A, B):
            assert self.t.pending(tp) == sum(1 for p, _ in nd if p == tp)

    def teardown(self) -> None:
        # deliver everything: the committable offset reaches last + 1 on every partition
        for tp, off in self._not_done():
            self.t.ack(tp, off)
            self.done[tp].add(off)
        offered = self.t.committable()
        for tp in (A, B):
            if self.tracked[tp]:
                want = self.tracked[tp][-1] + 1
                assert offered.get(tp, self.committed.get(tp)) == want


TrackerMachine.TestCase.settings = settings(max_examples=examples(100), stateful_step_count=30, deadline=None)
test_tracker_state_machine = TrackerMachine.TestCase


class LossMachine(RuleBasedStateMachine):
    """Random interleavings of receive / deliver / lose / late delivery / come back on two partitions: what
    ``take_lost`` reports is exactly the delivered prefix of what the lost assignment tracked, so skipping it
    never passes over a record without a result."""

    def __init__(self) -> None:
        super().__init__()
        self.t = OffsetTracker()
        self.next_off = {A: 0, B: 0}
        self.live: dict[TopicPartition, list[int]] = {A: [], B: []}  # tracked by the current assignment
        self.lost: dict[TopicPartition, list[int]] = {}  # tracked by the assignment lost last
        self.delivered: set[tuple[TopicPartition, int]] = set()

    @rule(tp=st.sampled_from([A, B]), gap=st.integers(0, 2))
    def receive(self, tp: TopicPartition, gap: int) -> None:
        off = self.next_off[tp] + gap
        assert self.t.track(tp, off)
        self.live[tp].append(off)
        self.next_off[tp] = off + 1

    def _undelivered(self, source: dict[TopicPartition, list[int]]) -> list[tuple[TopicPartition, int]]:
        return [(tp, o) for tp, offs in source.items() for o in offs if (tp, o) not in self.delivered]

    @precondition(lambda self: bool(self._undelivered(self.live)))
    @rule(data=st.data())
    def deliver(self, data: st.DataObject) -> None:
        tp, off = data.draw(st.sampled_from(self._undelivered(self.live)))
        assert self.t.ack(tp, off)
        self.delivered.add((tp, off))

    @rule(tp=st.sampled_from([A, B]))
    def lose(self, tp: TopicPartition) -> None:
        self.t.detach([tp])
        if self.live[tp]:
            self.lost[tp] = self.live[tp]
        self.live[tp] = []

    @precondition(lambda self: bool(self._undelivered(self.lost)))
    @rule(data=st.data())
    def deliver_late(self, data: st.DataObject) -> None:
        tp, off = data.draw(st.sampled_from(self._undelivered(self.lost)))
        assert self.t.ack_lost(tp, off)
        self.delivered.add((tp, off))

    @precondition(lambda self: bool(self.lost))
    @rule(tp=st.sampled_from([A, B]))
    def come_back(self, tp: TopicPartition) -> None:
        span = self.t.take_lost(tp)
        offs = self.lost.pop(tp, None)
        if offs is None:
            assert span is None
            return
        blocking = [o for o in offs if (tp, o) not in self.delivered]
        end = blocking[0] if blocking else offs[-1] + 1
        if end == offs[0]:
            assert span is None  # nothing delivered at the front
            return
        assert span == (offs[0], end)
        assert all((tp, o) in self.delivered for o in offs if o < end)

    @invariant()
    def in_flight_is_the_live_undelivered(self) -> None:
        assert self.t.in_flight() == len(self._undelivered(self.live))
        assert set(self.t.lost()) == set(self.lost)


LossMachine.TestCase.settings = settings(max_examples=examples(100), stateful_step_count=40, deadline=None)
test_loss_state_machine = LossMachine.TestCase


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.integers(0, 40), min_size=1, max_size=30, unique=True).map(sorted),
       st.lists(st.lists(st.integers(0, 45), max_size=12), max_size=6))
def test_ack_many_leaves_the_state_acking_one_by_one_leaves(tracked: list[int],
                                                            runs: list[list[int]]) -> None:
    """A delivered batch's run acked at once: the same done prefix, in-flight count and return
    count as its acks one by one, whatever the run holds (untracked, done already, repeated offsets)."""
    one, many = OffsetTracker(), OffsetTracker()
    for t in (one, many):
        for o in tracked:
            t.track(A, o)
    for run in runs:
        done = sum(one.ack(A, o) for o in run)
        assert many.ack_many(A, run) == done
        assert (many.committable(), many.in_flight(), many.pending(A), many.first_pending(A)) == (
            one.committable(), one.in_flight(), one.pending(A), one.first_pending(A))
    assert many.ack_many(B, [0, 1]) == 0  # an unknown partition: nothing


def _state(t: OffsetTracker) -> tuple[object, ...]:
    return t.committable(), t.in_flight(), t.pending(A), t.first_pending(A), t.span(A)


@settings(max_examples=examples(200), deadline=None)
@given(st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=8), max_size=6),
       st.lists(st.integers(0, 30), max_size=10))
def test_track_run_tracks_a_run_as_one_by_one_or_changes_nothing(runs: list[list[int]],
                                                                 acks: list[int]) -> None:
    """A poll batch's run of one partition: tracked whole exactly when tracking its offsets one by one
    would accept every one (then with the same state as that), else refused with nothing changed."""
    one, whole = OffsetTracker(), OffsetTracker()
    for run in runs:
        probe = copy.deepcopy(one)
        every = all(probe.track(A, o) for o in run)
        assert whole.track_run(A, run) is every
        if every:
            for o in run:
                one.track(A, o)
        assert _state(whole) == _state(one)
        for o in acks:
            assert whole.ack(A, o) == one.ack(A, o)
        assert _state(whole) == _state(one)
