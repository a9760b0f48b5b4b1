"""Runner backpressure: at ``max_in_flight`` every assigned partition that has returned a record is paused
and the loop keeps polling; it resumes only once in flight drops to ``resume_ratio * max_in_flight``
(hysteresis); a lane whose queue reaches its ``queue_bound`` pauses only the topics feeding that lane."""

from __future__ import annotations

import pytest

from tests.unit.fakes_kafka import Harness, make_config
from worker.core.records import TopicPartition

IN0, IN1 = TopicPartition("in", 0), TopicPartition("in", 1)
HI, LO = TopicPartition("in-hi", 0), TopicPartition("in-lo", 0)


def finish_records(h: Harness, n: int) -> None:
    """Run batches (max_batch_size 2) until ``n`` records have been finished and delivered."""
    done = 0
    while done < n:
        b = h.device.take()
        assert b is not None, f"only {done} of {n} records were ready"
        h.device.finish(b)
        done += len(b.records)
    assert done == n


def fourteen_on_in0_bound_10(monkeypatch: pytest.MonkeyPatch) -> Harness:
    """in/0 and in/1 assigned, 14 requests on in/0; max_in_flight 10, resume at 5, batches of 2, reads of
    4."""
    cfg = make_config(kafka={"poll_max_records": 4},
                      batching={"max_in_flight": 10, "resume_ratio": 0.5,
                                "lanes": [{"name": "default", "max_batch_size": 2, "max_wait_ms": 60_000}]})
    h = Harness(monkeypatch, cfg).start()
    h.c.assign(("in", 0), ("in", 1))
    h.c.resume_calls.clear()  # the assign's own (a partition comes back unpaused)
    h.send(14, partition=0)
    return h


def test_pauses_all_at_max_in_flight_and_resumes_only_below_the_low_watermark(
        monkeypatch: pytest.MonkeyPatch) -> None:
    h = fourteen_on_in0_bound_10(monkeypatch)
    h.iterate(2)
    assert h.runner.tracker.in_flight() == 8 and h.c.pause_calls == []
    h.iterate()  # reads only up to the bound (2 of the 4 offered): 10 >= 10, every partition read pauses
    assert h.runner.tracker.in_flight() == 10
    # in/1 has returned no record yet: left reading (tests/unit/test_flow_first_record.py)
    assert set(h.c.pause_calls[-1]) == {IN0} and h.c.paused == {IN0}
    polls = h.c.poll_calls
    h.iterate(3)
    assert h.c.poll_calls == polls + 3  # still polling (heartbeats, rebalances) while paused
    assert h.runner.tracker.in_flight() == 10  # ... but fetching nothing

    for expected_in_flight in (8, 6):  # above 0.5 * 10: stays paused (hysteresis)
        finish_records(h, 2)
        h.iterate()
        assert h.runner.tracker.in_flight() == expected_in_flight
        assert h.c.paused == {IN0} and h.c.resume_calls == []
    finish_records(h, 2)
    h.iterate()  # 4 <= 5: resume, and fetching continues
    assert set(h.c.resume_calls[-1]) == {IN0} and h.c.paused == set()
    h.iterate()
    assert h.runner.tracker.in_flight() > 4


def test_resume_only_touches_partitions_still_assigned(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = make_config(batching={"max_in_flight": 4, "resume_ratio": 0.5})
    h = Harness(monkeypatch, cfg).start()
    h.c.assign(("in", 0), ("in", 1))
    h.c.resume_calls.clear()  # the assign's own (a partition comes back unpaused)
    h.send(3, partition=0)
    h.send(3, partition=1)
    h.iterate()
    assert h.c.paused == {IN0, IN1}
    h.c.revoke(("in", 1))  # its queued records are dropped: in flight falls to in/0's 3
    h.device.run_all()
    h.iterate()
    assert h.c.paused == {IN1}  # in/0 resumed; in/1 keeps the pause it had when revoked (as with librdkafka)
    assert all(IN1 not in call for call in h.c.resume_calls)
    assert h.runner.partitions.paused == set()


def test_a_full_lane_pauses_only_its_own_topics(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = make_config(kafka={"input_topics": [], "poll_max_records": 6},
                      batching={"lanes": [{"name": "hi", "topics": ["in-hi"], "priority": 1, "queue_bound": 3,
                                           "max_batch_size": 8},
                                          {"name": "lo", "topics": ["in-lo"], "max_batch_size": 8}],
                                "default_lane": "lo", "max_in_flight": 1000})
    h = Harness(monkeypatch, cfg).start()
    h.c.assign(("in-hi", 0), ("in-lo", 0))
    h.c.resume_calls.clear()  # the assign's own
    h.send(6, topic="in-hi")
    h.send(6, topic="in-lo")
    h.iterate()  # 3 + 3 fetched: the hi lane holds 3 = its queue_bound
    assert h.runner.scheduler.queued("hi") == 3
    assert h.c.pause_calls == [[HI]] and h.c.paused == {HI}
    h.iterate()  # lo keeps flowing, hi does not
    assert h.runner.scheduler.queued("lo") == 6 and h.runner.scheduler.queued("hi") == 3
    b = h.device.take()
    assert b is not None and b.lane == "hi"  # on the device now: no longer queued
    h.iterate()
    assert h.c.resume_calls == [[HI]] and h.c.paused == set()
    h.iterate()
    assert h.runner.scheduler.queued("hi") == 3  # refilled up to the bound, paused again
    assert h.c.paused == {HI}


def test_records_routed_to_a_full_lane_by_field_do_not_pause_other_lanes_topics(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The lane pause follows topic -> lane routing; a lane fed only by a header/field cannot be paused
    by topic, and the global max_in_flight still bounds it."""
    from tests.unit.fakes_kafka import request

    cfg = make_config(batching={"lanes": [{"name": "hi", "priority": 1, "queue_bound": 2},
                                          {"name": "default"}],
                                "max_in_flight": 6})
    h = Harness(monkeypatch, cfg).start()
    h.c.assign(("in", 0))
    for i in range(8):
        h.c.append("in", 0, request(f"r{i}", i, priority="hi"))
    h.iterate()
    assert h.runner.scheduler.queued("hi") == 6  # the fetch stops at max_in_flight
    assert h.c.paused == {IN0}  # by max_in_flight, not by the lane (in -> default lane)


def test_a_resumed_partition_is_sought_to_its_own_position_to_wake_the_fetcher(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """librdkafka resumes fetching only at its broker thread's next wake-up (~1 s); a seek wakes it. The seek
    goes to the partition's own position, so nothing is skipped or read twice; a partition with nothing read
    yet (no position) is not sought."""
    h = fourteen_on_in0_bound_10(monkeypatch)
    h.iterate(3)
    assert h.c.paused == {IN0} and h.c.seek_calls == []
    finish_records(h, 6)
    h.iterate()
    assert h.c.paused == set() and h.c.seek_calls == [(IN0, 10)]  # in/1: nothing read, left alone
    for _ in range(10):
        h.iterate()
        h.device.run_all()
    h.iterate()
    ids = h.result_ids()
    # each once: nothing skipped, nothing re-read
    assert sorted(ids) == sorted(f"in-0-{i}" for i in range(14))
