"""The backpressure decision (worker/core/backpressure.py): which assigned partitions to hold paused."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from worker.core.backpressure import partitions_to_pause
from worker.core.records import TopicPartition

HI0, HI1, LO0, LO1 = (TopicPartition("hi", 0), TopicPartition("hi", 1), TopicPartition("lo", 0),
                      TopicPartition("lo", 1))
ALL = frozenset({HI0, HI1, LO0, LO1})


def lane_of(tp: TopicPartition) -> str:
    return "high" if tp.topic == "hi" else "low"


def decide(in_flight: int, **kw: object) -> set[TopicPartition]:
    args: dict = {"bound": 100, "resume_ratio": 0.5, "assigned": ALL, **kw}
    return partitions_to_pause(in_flight=in_flight, **args).want


def test_below_the_bound_nothing_is_paused() -> None:
    assert decide(99) == set()


def test_at_the_bound_every_assigned_partition_pauses() -> None:
    assert decide(100) == set(ALL)
    assert decide(500) == set(ALL)


def test_paused_partitions_stay_paused_until_the_low_watermark() -> None:
    assert decide(51, holding=True) == set(ALL)  # above bound * resume_ratio: no flapping
    assert decide(50, holding=True) == set()
    assert decide(51) == set()  # the bound was never reached: nothing to hold
    assert partitions_to_pause(in_flight=100, bound=100, resume_ratio=0.5, assigned=ALL).holding
    assert partitions_to_pause(in_flight=51, bound=100, resume_ratio=0.5, assigned=ALL, holding=True).holding
    assert not partitions_to_pause(in_flight=50, bound=100, resume_ratio=0.5, assigned=ALL,
                                   holding=True).holding


def test_a_pause_for_one_reason_is_not_held_by_another_reasons_low_watermark() -> None:
    """In-flight between the low watermark and the bound (other lanes busy): a partition paused for its span
    or for a full lane resumes once its own reason clears; it used to stay paused until in-flight fell to
    bound * resume_ratio, whatever had paused it."""
    assert decide(80, spans={LO0: 0}, span_bound=1000, span_held=frozenset({LO0})) == set()
    assert decide(80, full_lanes=set(), lane_of=lane_of) == set()


def test_a_full_lane_pauses_only_the_partitions_routed_to_it() -> None:
    assert decide(10, full_lanes={"low"}, lane_of=lane_of) == {LO0, LO1}
    assert decide(10, full_lanes=set(), lane_of=lane_of) == set()


def test_backfill_partitions_read_to_their_end_stay_paused() -> None:
    gone = TopicPartition("hi", 9)  # revoked: never paused
    assert decide(10, reached={HI1, gone}) == {HI1}


def test_revoked_partitions_are_dropped_from_the_hysteresis() -> None:
    gone = TopicPartition("lo", 9)
    assert decide(60, holding=True, assigned=frozenset({LO0})) == {LO0}
    assert decide(10, spans={LO0: 600, gone: 600}, span_bound=1000, span_held=frozenset({LO0, gone})) == {LO0}


@given(in_flight=st.integers(0, 300), holding=st.booleans(),
       reached=st.sets(st.sampled_from(sorted(ALL))), full=st.sets(st.sampled_from(["high", "low"])))
def test_every_reason_is_honoured_and_nothing_unassigned_is_paused(in_flight: int, holding: bool,
                                                                   reached: set[TopicPartition],
                                                                   full: set[str]) -> None:
    assigned = frozenset({HI0, LO0, LO1})
    want = partitions_to_pause(in_flight=in_flight, bound=100, resume_ratio=0.5, assigned=assigned,
                               holding=holding, reached=frozenset(reached), full_lanes=full,
                               lane_of=lane_of).want
    assert want <= assigned
    assert reached & assigned <= want
    assert {tp for tp in assigned if lane_of(tp) in full} <= want
    if in_flight >= 100:
        assert want == assigned
    if not reached and not full and in_flight <= 50:
        assert want == set()


def test_a_partition_whose_uncommitted_span_reaches_its_bound_pauses_alone() -> None:
    # Behind one stuck record, finished ones count nowhere else: the span bound stops reading that partition.
    assert decide(10, spans={LO0: 1000, HI0: 999}, span_bound=1000) == {LO0}
    assert decide(10, spans={LO0: 501}, span_bound=1000, span_held=frozenset({LO0})) == {LO0}  # hysteresis
    assert decide(10, spans={LO0: 500}, span_bound=1000, span_held=frozenset({LO0})) == set()
    assert decide(10, spans={LO0: 501}, span_bound=1000) == set()  # paused for another reason: not held
    assert decide(10, spans={TopicPartition("lo", 9): 5000}, span_bound=1000) == set()  # not assigned
