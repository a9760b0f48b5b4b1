"""The iteration-level scheduler, driven by hand with a fake clock and fake tokens."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.support.props import examples
from worker.core.step_model import GenParams
from worker.core.step_scheduler import LaneRule, SeqState, StepScheduler

EOS = 0


def detok(ids: Sequence[int]) -> str:
    return "".join(chr(ord("a") + (i - 1) % 26) for i in ids)  # 1 -> "a", 2 -> "b", ...


def make(lanes: Sequence[LaneRule] = (LaneRule("default"),), headroom: int = 0, admission: str = "reserve",
         **kw: int) -> StepScheduler:
    opts = {"max_sequences": 4, "max_batch_tokens": 1000, "max_context": 512} | kw
    return StepScheduler(lanes, eos_token_id=EOS, detokenize=detok, headroom=headroom, admission=admission,
                         **opts)


def params(n: int = 4, stop: tuple[str, ...] = ()) -> GenParams:
    return GenParams(max_new_tokens=n, stop=stop)


def step(s: StepScheduler, now: float, token: int = 1) -> tuple[list[int], list[str]]:
    plan = s.schedule(now)
    done = s.update([token] * len(plan.seq_ids), now)
    return [x.id for x in plan.admitted], [x.reason or "" for x in done]


def test_sequence_runs_to_max_new_tokens_and_leaves_at_once() -> None:
    s = make()
    a = s.submit("a", "default", [5, 6], params(2), 0.0)
    b = s.submit("b", "default", [5], params(4), 0.0)
    assert step(s, 1.0) == ([a.id, b.id], [])
    assert step(s, 2.0) == ([], ["length"])
    assert a.state is SeqState.FINISHED and a.tokens == [1, 1]
    assert a.first_token_at == 1.0 and a.ended_at == 2.0
    assert s.running == 1 and s.reserved_tokens == b.reserved == 5
    c = s.submit("c", "default", [5], params(1), 2.5)
    admitted, reasons = step(s, 3.0)
    assert admitted == [c.id] and reasons == ["length"]  # c joined b's running batch and left after a step
    assert s.schedule(4.0).seq_ids == (b.id,)


def test_eos_is_not_kept_and_finishes() -> None:
    s = make()
    a = s.submit("a", "default", [5], params(10), 0.0)
    step(s, 0.0, token=3)
    assert step(s, 1.0, token=EOS) == ([], ["eos"])
    assert a.tokens == [3]


def test_stop_string_cuts_the_text() -> None:
    s = make()
    a = s.submit("a", "default", [5], params(10, stop=("cd",)), 0.0)
    for tok in (1, 2, 3):  # "abc": no stop yet
        assert step(s, 0.0, token=tok)[1] == []
    assert step(s, 0.0, token=4)[1] == ["stop"]
    assert a.text == "ab" and a.tokens == [1, 2, 3, 4]


def test_context_limit_finishes_and_too_long_prompt_fails() -> None:
    s = make(max_context=4)
    a = s.submit("a", "default", [1, 2], params(100), 0.0)
    bad = s.submit("bad", "default", [1, 2, 3, 4], params(1), 0.0)
    plan = s.schedule(0.0)
    assert plan.ended == (bad,) and bad.state is SeqState.FAILED and "context is 4" in (bad.error or "")
    s.update([1] * len(plan.seq_ids), 0.0)
    assert step(s, 1.0)[1] == ["context"] and a.tokens == [1, 1]
    assert a.reserved == 4  # capped at the context


def test_slots_bound_admission() -> None:
    s = make(max_sequences=2)
    seqs = [s.submit(i, "default", [1], params(3), 0.0) for i in range(3)]
    plan = s.schedule(0.0)
    assert [x.id for x in plan.admitted] == [seqs[0].id, seqs[1].id] and s.waiting == 1


def test_token_budget_reserves_prompt_plus_max_new_and_head_blocks() -> None:
    s = make(max_batch_tokens=10)
    a = s.submit("a", "default", [1, 1, 1], params(3), 0.0)  # reserves 6
    big = s.submit("big", "default", [1, 1], params(4), 0.0)  # 6: does not fit beside a
    small = s.submit("small", "default", [1], params(1), 0.0)  # 2: would fit, but waits behind big
    plan = s.schedule(0.0)
    assert plan.admitted == (a,) and s.reserved_tokens == 6
    s.update([1], 0.0)
    s.update([1] * len(s.schedule(1.0).seq_ids), 1.0)
    s.update([1] * len(s.schedule(2.0).seq_ids), 2.0)  # a finished: 3 tokens
    assert a.state is SeqState.FINISHED
    plan = s.schedule(3.0)
    assert plan.admitted == (big, small) and s.reserved_tokens == 8


def test_a_sequence_over_the_budget_runs_alone() -> None:
    s = make(max_batch_tokens=4)
    huge = s.submit("huge", "default", [1, 1, 1], params(5), 0.0)
    assert s.schedule(0.0).admitted == (huge,)
    s.update([1], 0.0)
    other = s.submit("o", "default", [1], params(1), 0.0)
    assert s.schedule(1.0).admitted == ()  # waits until huge leaves
    s.update([1], 1.0)
    assert other.state is SeqState.WAITING


def test_deadline_expires_waiting_and_running_with_partial_tokens() -> None:
    s = make(max_sequences=1)
    run = s.submit("r", "default", [1], params(10), 0.0, deadline=2.5)
    wait = s.submit("w", "default", [1], params(10), 0.0, deadline=1.5)
    step(s, 0.0, token=2)
    step(s, 1.0, token=3)
    plan = s.schedule(2.0)
    assert plan.ended == (wait,) and wait.state is SeqState.EXPIRED and wait.tokens == []
    s.update([4], 2.0)
    plan = s.schedule(3.0)
    assert plan.ended == (run,) and run.state is SeqState.EXPIRED and run.reason == "deadline"
    assert run.tokens == [2, 3, 4] and s.reserved_tokens == 0 and plan.seq_ids == ()


def test_high_priority_lane_admitted_first_and_low_lane_not_starved() -> None:
    lanes = [LaneRule("bulk", priority=0, weight=1.0), LaneRule("live", priority=10, weight=3.0)]
    s = make(lanes, max_sequences=1)
    for i in range(40):
        s.submit(("bulk", i), "bulk", [1], params(1), 0.0)
        s.submit(("live", i), "live", [1], params(1), 0.0)
    order = []
    for t in range(60):
        admitted = s.schedule(float(t)).admitted
        order += [x.lane for x in admitted]
        s.update([1] * s.running, float(t))
    assert order[0] == "live"
    assert order[:3] == ["live"] * 3  # a set of slots (1 / min weight) of lag before bulk's turn
    assert 0 < order.count("bulk") < order.count("live")  # weighted share, not starvation
    late = [LaneRule("a"), LaneRule("b")]
    s2 = make(late, max_sequences=1)
    for i in range(5):
        s2.submit(i, "a", [1], params(1), 0.0)
    for t in range(5):
        s2.schedule(float(t))
        s2.update([1] * s2.running, float(t))
    s2.submit("x", "a", [1], params(1), 5.0)
    s2.submit("y", "b", [1], params(1), 5.0)  # b idled while a ran: no credit to burst with
    assert [x.key for x in s2.schedule(5.0).admitted] == ["x"]


def test_unknown_lane_goes_to_the_highest_lane() -> None:
    s = make([LaneRule("lo"), LaneRule("hi", priority=5)])
    assert s.submit("a", "nope", [1], params(), 0.0).lane == "hi"


def test_drop_abandons_running_and_waiting_and_skips_their_tokens() -> None:
    s = make(max_sequences=1)
    a = s.submit("p0", "default", [1], params(5), 0.0)
    b = s.submit("p1", "default", [1], params(5), 0.0)
    plan = s.schedule(0.0)
    dropped = s.drop(lambda x: x.key == "p0", 0.5)  # while the step runs
    assert dropped == [a] and a.state is SeqState.ABANDONED
    assert s.update([1] * len(plan.seq_ids), 1.0) == [] and a.tokens == []
    assert s.schedule(1.0).admitted == (b,)
    assert s.drop(lambda x: True, 2.0) == [b] and len(s) == 0 and s.reserved_tokens == 0


def test_failed_step_fails_running_only() -> None:
    s = make(max_sequences=1)
    a = s.submit("a", "default", [1], params(5), 0.0)
    b = s.submit("b", "default", [1], params(5), 0.0)
    s.schedule(0.0)
    assert s.fail_running("boom", 1.0) == [a] and a.error == "boom" and b.state is SeqState.WAITING
    with pytest.raises(ValueError, match="2 tokens for 1"):
        s.schedule(2.0)
        s.update([1, 1], 2.0)


ops = st.lists(st.one_of(
    st.tuples(st.just("submit"), st.sampled_from(["hi", "lo"]), st.integers(1, 12), st.integers(1, 9),
              st.none() | st.integers(1, 30)),
    st.tuples(st.just("step"), st.integers(0, 3)),
    st.tuples(st.just("drop"), st.integers(0, 4)),
    st.tuples(st.just("fail")),
), max_size=80)


@settings(max_examples=examples(200), deadline=None)
@given(ops, st.integers(1, 4), st.integers(4, 30), st.sampled_from(["reserve", "grow"]))
@example([("submit", "hi", 12, 9, None), ("submit", "lo", 1, 1, None), ("step", 1)], 2, 4, "reserve")
@example([("submit", "lo", 1, 9, None)] * 4 + [("submit", "hi", 1, 9, None)] + [("step", 1)] * 12, 4, 10,
         "grow")
# A submit between a step and the next schedule: the caches still hold the step's tokens (over the budget
# by up to one token per running sequence) until that schedule preempts.
@example([("submit", "hi", 1, 3, None), ("submit", "hi", 1, 3, None), ("step", 1), ("step", 1),
          ("submit", "hi", 1, 1, None)], 2, 6, "grow")
def test_every_sequence_ends_exactly_once_and_limits_hold(ops: list[tuple], slots: int, budget: int,
                                                          admission: str) -> None:
    s = make([LaneRule("lo"), LaneRule("hi", priority=1, weight=2.0)], max_sequences=slots, headroom=3,
             max_batch_tokens=budget, max_context=16, admission=admission)
    submitted: list = []
    handed: list = []
    now = 0.0

    # "grow": the last step added a token to each running cache; until the next schedule preempts, they may
    # hold up to one token per running sequence over the budget.
    grown = False

    def check() -> None:
        assert s.running <= slots
        slack = s.running if grown and admission == "grow" else 0
        assert s.reserved_tokens <= budget + slack or s.running == 1
        assert s.reserved_tokens == sum(x.reserved for x in submitted if x.state is SeqState.RUNNING)

    def one_round(tok: int) -> None:
        nonlocal grown
        plan = s.schedule(now)
        grown = False
        handed.extend(plan.ended)
        check()
        handed.extend(s.update([tok] * len(plan.seq_ids), now))
        grown = True

    for op in ops:
        now += 1.0
        if op[0] == "submit":
            _, lane, prompt, new, dl = op
            submitted.append(s.submit(len(submitted), lane, [1] * prompt, params(new), now,
                                      None if dl is None else now + dl))
        elif op[0] == "step":
            one_round(op[1])
        elif op[0] == "drop":
            handed.extend(s.drop(lambda x, m=op[1]: x.key % 5 == m, now))
        else:
            handed.extend(s.fail_running("boom", now))
        check()
    for _ in range(5000):  # drains: every sequence ends (max_new_tokens and the context bound each one)
        if not len(s) and not s._refused:
            break
        now += 1.0
        one_round(1)
    assert len(s) == 0
    assert sorted(x.id for x in handed) == [x.id for x in submitted]  # each one, exactly once
    assert all(x.state in {SeqState.FINISHED, SeqState.EXPIRED, SeqState.FAILED, SeqState.ABANDONED}
               for x in submitted)


def test_headroom_is_for_the_highest_lane_only() -> None:
    s = make([LaneRule("lo"), LaneRule("hi", priority=1)], max_sequences=10, max_batch_tokens=10, headroom=4)
    lo = [s.submit(i, "lo", [1], params(2), 0.0) for i in range(4)]  # 3 tokens each
    assert s.schedule(0.0).admitted == (lo[0], lo[1])  # 6 <= 10 - 4; a third would cut into the headroom
    hi = s.submit("h", "hi", [1], params(2), 0.5)
    assert s.schedule(1.0).admitted == (hi,) and s.reserved_tokens == 9


def test_grow_admits_by_cached_tokens_and_preempts_the_lowest_latest() -> None:
    s = make([LaneRule("lo"), LaneRule("hi", priority=1)], max_sequences=8, max_batch_tokens=20,
             admission="grow")  # watermark 2
    a = s.submit("a", "hi", [1] * 4, params(30), 0.0)  # reserve would hold 34 > 20: here 5 at first
    b = s.submit("b", "lo", [1] * 4, params(30), 0.0)
    c = s.submit("c", "lo", [1] * 4, params(30), 0.0)
    plan = s.schedule(0.0)
    assert plan.admitted == (a, b, c) and s.reserved_tokens == 15
    s.update([1, 1, 1], 0.0)  # 18
    assert s.schedule(1.0).preempted == ()
    s.update([1, 1, 1], 1.0)  # 21 > 20: c, the latest of the lowest lane, goes back with its tokens dropped
    plan = s.schedule(2.0)
    assert plan.preempted == (c,) and c.state is SeqState.WAITING and c.tokens == []
    assert plan.seq_ids == (a.id, b.id) and s.reserved_tokens == 14 and s.preemptions == 1
    s.update([1, 1], 2.0)
    assert s.schedule(3.0).admitted == ()  # 16 + 5 + watermark 2 > 20


def test_grow_high_head_preempts_lower_lanes_to_start_at_once() -> None:
    s = make([LaneRule("lo"), LaneRule("hi", priority=1)], max_sequences=8, max_batch_tokens=20,
             admission="grow")  # watermark 2
    lo = [s.submit(i, "lo", [1] * 4, params(30), 0.0) for i in range(3)]
    assert s.schedule(0.0).admitted == tuple(lo) and s.reserved_tokens == 15
    s.update([1, 1, 1], 0.0)  # 18
    hi = s.submit("h", "hi", [1] * 3, params(5), 0.5)  # 4 + watermark 2: needs 4 freed
    plan = s.schedule(1.0)
    assert plan.preempted == (lo[2],) and plan.admitted == (hi,)
    assert plan.seq_ids == (lo[0].id, lo[1].id, hi.id) and s.reserved_tokens == 16
    late = s.submit("h2", "hi", [1] * 20, params(5), 1.5)  # no preemption can make room: none happens
    assert s.schedule(2.0).preempted == () and late.state is SeqState.WAITING
