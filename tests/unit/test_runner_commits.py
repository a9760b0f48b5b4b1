"""Runner, at-least-once commits: an offset is committed only when its record and
every earlier record of its partition are delivered, whatever order lanes and deliveries finish in; a
failed delivery is retried and blocks the commit until it succeeds; after the last retry the worker stops
with exit code 1 without committing past the record."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from tests.unit.fakes_kafka import Harness, Produced, make_config, request
from worker.core.records import TopicPartition

IN0 = TopicPartition("in", 0)

LANES = {"lanes": [{"name": "hi", "priority": 1, "max_batch_size": 8, "fill_with_lower": False},
                   {"name": "lo", "max_batch_size": 8}],
         "default_lane": "lo"}


def src_offset(p: Produced) -> int:
    return int(p.json()["source"]["offset"])


def all_commits(h: Harness, tp: TopicPartition = IN0) -> list[int]:
    return [c[tp] for c in h.c.commit_calls if tp in c]


def turns_until(h: Harness, done: Callable[[], bool], max_turns: int = 200) -> int:
    """Loop turns (each moves the fake clock by its poll timeout) until ``done()``; retries back off."""
    for turn in range(max_turns):
        if done():
            return turn
        h.iterate()
    raise AssertionError(f"not done after {max_turns} loop turns")


def test_lanes_finishing_out_of_order_commit_only_the_delivered_prefix(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = Harness(monkeypatch, make_config(batching=LANES), devices=2).start()
    h.c.assign(("in", 0))
    lanes = ["lo", "lo", "hi", "hi", "lo", "hi"]
    for i, lane in enumerate(lanes):
        h.c.append("in", 0, request(f"r{i}", i, priority=lane))
    h.iterate()
    hi = h.device.take()
    lo = h.devices[1].take()
    assert hi is not None and lo is not None
    assert (hi.lane, [r.offset for r in hi.records]) == ("hi", [2, 3, 5])
    assert (lo.lane, [r.offset for r in lo.records]) == ("lo", [0, 1, 4])

    h.device.finish(hi)  # the high lane finishes first: 2, 3, 5 delivered, 0 still on the device
    h.iterate()
    assert sorted(src_offset(p) for p in h.p.delivered) == [2, 3, 5]
    h.commit()
    assert h.c.commit_calls == []  # nothing before offset 0 is done: no commit at all

    h.devices[1].finish(lo)
    h.iterate()
    h.commit()
    assert all_commits(h) == [6]
    assert h.runner.tracker.in_flight() == 0


ONE_BY_ONE = {"lanes": [{"name": "default", "max_batch_size": 1}]}


def finish(h: Harness, batches: list[Any], offsets: set[int], tp: TopicPartition = IN0) -> None:
    """Finish, in the order given, the one-record batches of ``tp`` whose offsets are listed."""
    for b in [b for b in batches if b.records[0].tp == tp and b.records[0].offset in offsets]:
        h.device.finish(b)


def test_produced_but_undelivered_results_block_the_commit(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch, make_config(batching=ONE_BY_ONE)).start()
    h.c.assign(("in", 0))
    h.send(5)
    h.iterate()
    h.p.hold = True  # the broker has not acknowledged anything yet
    h.device.run_all()
    h.iterate()
    assert len(h.p.produced) == 5 and h.p.delivered == []
    h.commit()
    assert h.c.commit_calls == []

    # Acknowledged in part: nothing is confirmed while the producer still has messages outstanding (the
    # record is done when its producer has drained, not by a report per message).
    h.p.deliver(lambda p: src_offset(p) in (0, 1, 3))
    h.iterate()
    h.commit()
    assert h.c.commit_calls == [] and h.runner.emitter.unconfirmed == 5
    h.p.deliver(lambda p: True)
    h.iterate()
    h.commit()
    assert all_commits(h) == [5]


def test_records_finishing_out_of_order_commit_only_the_done_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch, make_config(batching=ONE_BY_ONE)).start()
    h.c.assign(("in", 0))
    h.send(5)
    h.iterate()
    batches = [h.device.take() for _ in range(5)]
    finish(h, batches, {0, 1, 3})
    h.iterate()
    h.commit()
    assert all_commits(h) == [2]  # never past the gap at 2
    finish(h, batches, {4})
    h.iterate()
    h.commit()
    assert all_commits(h) == [2]  # nothing new committable: no second commit call
    finish(h, batches, {2})
    h.iterate()
    h.commit()
    assert all_commits(h) == [2, 5]


def test_offset_gaps_from_compaction_are_not_holes(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch, make_config(batching=ONE_BY_ONE)).start()
    h.c.assign(("in", 0))
    for off in (3, 4, 9, 20):
        h.c.append("in", 0, request(f"r{off}"), offset=off)
    h.iterate()
    batches = [h.device.take() for _ in range(4)]
    finish(h, batches, {3, 4, 20})
    h.iterate()
    h.commit()
    assert all_commits(h) == [9]  # next to read is 9, still in flight
    finish(h, batches, {9})
    h.iterate()
    h.commit()
    assert all_commits(h) == [9, 21]


def test_partitions_commit_independently(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch, make_config(batching=ONE_BY_ONE)).start()
    h.c.assign(("in", 0), ("in", 1))
    h.send(3, partition=0)
    h.send(2, partition=1)
    h.iterate()
    batches = [h.device.take() for _ in range(5)]
    finish(h, batches, {0}, IN0)
    finish(h, batches, {0, 1}, TopicPartition("in", 1))
    h.iterate()
    h.commit()
    assert h.c.commit_calls == [{IN0: 1, TopicPartition("in", 1): 2}]


def test_with_a_spare_producer_a_record_commits_once_the_producer_it_went_on_has_drained(
        monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch, make_config(batching=ONE_BY_ONE), spare=True).start()
    assert h.spare is not None and h.runner.emitter.slots[1].producer is h.spare
    h.c.assign(("in", 0))
    h.send(2)
    h.iterate()
    h.p.hold = h.spare.hold = True
    first, second = h.device.take(), h.device.take()
    h.device.finish(first)
    h.iterate()  # result 0 goes on the first producer
    h.clock.advance(0.01)
    h.iterate()  # it has not drained: sending moves to the spare
    h.device.finish(second)
    h.iterate()
    assert [src_offset(m) for m in h.p.produced] == [0] and [src_offset(m) for m in h.spare.produced] == [1]
    h.spare.hold = False
    h.iterate()
    h.commit()
    assert h.c.commit_calls == []  # 1 is confirmed, 0 is not: nothing committable
    h.p.hold = False
    h.iterate()
    h.commit()
    assert all_commits(h) == [2]


def test_periodic_commit_follows_commit_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch, make_config(kafka={"commit_interval_ms": 1000})).start()
    h.c.assign(("in", 0))
    h.send(2)
    h.process()
    assert h.c.commit_calls == []  # delivered, but the interval has not passed
    h.clock.advance(1.0)
    h.iterate()
    assert all_commits(h) == [2]


def test_failed_commit_is_not_fatal_and_is_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    from confluent_kafka import KafkaError, KafkaException

    h = Harness(monkeypatch).start()
    h.c.assign(("in", 0))
    h.send(2)
    h.process()
    h.c.commit_failures.append(KafkaException(KafkaError(KafkaError.REBALANCE_IN_PROGRESS, "rebalancing")))
    h.commit()
    assert h.committed() is None and h.runner.fatal is None
    h.commit()
    assert h.committed() == 2
    assert all_commits(h) == [2, 2]


def test_periodic_commit_is_asynchronous_and_counted_when_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch, make_config(kafka={"commit_interval_ms": 100})).start()
    h.c.assign(("in", 0))
    h.send(3)
    h.process()
    h.clock.advance(0.2)
    h.iterate()  # the interval passed: the commit is sent, the loop does not wait for the broker
    assert all_commits(h) == [3]
    assert h.runner.mode.in_flight is not None and h.runner.stats.commits == 0
    h.iterate()  # poll() serves the report
    assert h.runner.mode.in_flight is None and h.runner.stats.commits == 1
    assert h.runner.committed[IN0] == 3
    h.clock.advance(0.2)
    h.iterate()
    h.iterate()
    assert all_commits(h) == [3]  # nothing new: not committed again


def test_failed_asynchronous_commit_is_counted_and_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    from confluent_kafka import KafkaError, KafkaException

    from worker.observability.metrics import PrometheusMetrics

    metrics = PrometheusMetrics()
    h = Harness(monkeypatch, make_config(kafka={"commit_interval_ms": 100}), metrics=metrics).start()
    h.c.assign(("in", 0))
    h.send(2)
    h.process()
    h.c.commit_failures.append(KafkaException(KafkaError(KafkaError.REBALANCE_IN_PROGRESS, "rebalancing")))
    h.clock.advance(0.2)
    h.iterate()
    h.iterate()  # the failure is reported inside poll()
    assert h.runner.fatal is None and h.runner.stats.commits == 0
    assert metrics.commit_failures_total._value.get() == 1
    h.clock.advance(0.2)
    h.iterate()
    h.iterate()
    assert all_commits(h) == [2, 2] and h.committed() == 2 and h.runner.stats.commits == 1


# ------------------------------------------------------------------------------------------ delivery failures
def test_failed_delivery_is_retried_and_blocks_the_commit_until_it_succeeds(
        monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch).start()
    h.c.assign(("in", 0))
    h.send(3)
    h.iterate()
    h.device.run_all()
    h.p.fail_if = lambda p: _timeout() if src_offset(p) == 1 and not h.p.failed else None
    h.iterate()  # 0 and 2 delivered, 1 failed once -> re-sent (after a short backoff)
    assert [src_offset(p) for p in h.p.failed] == [1]
    assert h.runner.tracker.pending(IN0) == 1  # not done: its retry is owed
    h.commit()
    assert all_commits(h) == [1]  # not past the failed record
    turns_until(h, lambda: len(h.p.delivered) == 3)  # the retry is delivered
    h.commit()
    assert all_commits(h) == [1, 3]
    assert sorted(src_offset(p) for p in h.p.delivered) == [0, 1, 2]
    assert h.runner.fatal is None


def test_a_record_done_only_when_its_result_and_its_dead_letter_are_delivered(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """An inference error owes a result and a dead letter; a failed DLQ delivery re-sends both and the
    offset waits for them."""
    h = Harness(monkeypatch).start()
    h.c.assign(("in", 0))
    h.c.append("in", 0, request("bad", "poison"))
    h.iterate()
    h.device.run_all()
    h.p.fail_next(1, topic="dlq")
    h.iterate()
    assert [p.topic for p in h.p.delivered] == ["out"] and [p.topic for p in h.p.failed] == ["dlq"]
    h.commit()
    assert h.c.commit_calls == []
    turns_until(h, lambda: h.runner.tracker.in_flight() == 0)
    h.commit()
    assert all_commits(h) == [1]
    assert [p.topic for p in h.p.delivered] == ["out", "out", "dlq"]  # the result was re-sent too (allowed)


def _timeout() -> Any:
    from confluent_kafka import KafkaError

    return KafkaError(KafkaError._MSG_TIMED_OUT, "Local: Message timed out")


def _fail_offset_1_forever(h: Harness) -> None:
    h.p.fail_if = lambda p: _timeout() if p.topic == "out" and src_offset(p) == 1 else None


def _results_of_offset_1_never_delivered(monkeypatch: pytest.MonkeyPatch, n: int) -> Harness:
    """n records read and run; every delivery of offset 1's result fails from now on."""
    h = Harness(monkeypatch).start()
    h.c.assign(("in", 0))
    h.send(n)
    h.iterate()
    h.device.run_all()
    _fail_offset_1_forever(h)
    return h


def _until_fatal(h: Harness) -> None:
    for _ in range(500):  # retries back off (fake time moves with each turn's poll timeout)
        h.iterate()
        if h.runner.fatal:
            break


def test_after_max_retries_the_runner_is_fatal_and_never_commits_past_the_record(
        monkeypatch: pytest.MonkeyPatch) -> None:
    h = _results_of_offset_1_never_delivered(monkeypatch, 3)
    _until_fatal(h)
    assert h.runner.fatal is not None and "in[0]@1" in h.runner.fatal
    assert len(h.p.failed) == 1 + 5  # the first try + the 5 retries README promises
    h.commit()
    assert all_commits(h) == [1]


def test_a_failed_delivery_is_retried_only_after_its_backoff(monkeypatch: pytest.MonkeyPatch) -> None:
    h = _results_of_offset_1_never_delivered(monkeypatch, 2)
    sent_at: list[float] = []
    produce = h.p.produce

    def timed_produce(topic: str, *a: Any, **kw: Any) -> None:
        produce(topic, *a, **kw)
        if topic == "out" and src_offset(h.p.produced[-1]) == 1:
            sent_at.append(h.clock.t)

    h.p.produce = timed_produce  # type: ignore[method-assign]
    _until_fatal(h)
    gaps = [b - a for a, b in zip(sent_at, sent_at[1:], strict=False)]
    # Backoff min(0.05 * attempt, 0.5) s after each failure (the failure itself is reported at once here).
    assert len(gaps) == 5 and all(g >= 0.05 * (i + 1) - 1e-9 for i, g in enumerate(gaps)), gaps


def test_run_exits_1_after_max_retries_and_commits_only_below_the_record(
        monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch)
    h.send(4)
    h.c.schedule(lambda: h.c.assign(("in", 0)))
    h.device.auto = True
    h.c.hooks.append(h.device.hook)
    _fail_offset_1_forever(h)
    assert h.run() == 1
    assert max(all_commits(h)) == 1 and h.committed() == 1
    assert h.c.closed and h.device.stopped
    assert "in[0]@1" in (h.runner.fatal or "")
    # every other record was delivered; the failed one is left for the restart
    assert sorted(src_offset(p) for p in h.p.delivered if p.topic == "out") == [0, 2, 3]


def test_retry_backoff_does_not_block_the_loop_for_long(monkeypatch: pytest.MonkeyPatch) -> None:
    """A broker outage fails every in-flight delivery at once; the retries must not stall the loop thread
    (heartbeats, rebalance callbacks and max.poll.interval.ms depend on it) for seconds."""
    h = Harness(monkeypatch).start()
    h.c.assign(("in", 0))
    h.send(200)
    h.iterate()
    h.device.run_all()
    h.p.fail_next(200, topic="out")  # a broker outage fails every in-flight delivery once
    for _ in range(50):
        h.iterate()
    h.commit()
    assert all_commits(h) == [200]
    assert sum(h.clock.slept) <= 1.0, f"the loop thread slept {sum(h.clock.slept):.1f} s"


def test_stale_delivery_failures_are_not_retried(monkeypatch: pytest.MonkeyPatch) -> None:
    """A record of a revoked partition whose delivery failed is not re-sent (the new owner redoes it)."""
    h = Harness(monkeypatch).start()
    h.c.assign(("in", 0))
    h.send(1)
    h.iterate()
    h.device.run_all()
    h.p.hold = True
    h.iterate()
    h.p.fail_next(1, topic="out")
    h.c.revoke(("in", 0))  # revoke_timeout passes with the report still held
    h.p.hold = False
    h.iterate()  # the failure report arrives now; the record is stale
    h.iterate()
    assert len(h.p.produced) == 1 and len(h.p.failed) == 1
    assert h.runner.fatal is None
    assert h.c.commit_calls == []


@pytest.mark.parametrize("mode", ["at_least_once", "exactly_once"])
def test_results_that_cannot_be_written_are_counted_as_errors_and_dead_letters(
    monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    """An ok output the encoder cannot write goes out as an error result with an output dead letter; it was
    counted as ok, and never in kiw_dlq_total, so the alert on dead letters never fired however broken the
    model's outputs were."""
    from tests.unit.fakes_kafka import FakeModel
    from tests.unit.test_metrics import value
    from worker.observability.metrics import PrometheusMetrics

    m = PrometheusMetrics()
    cfg = make_config(delivery={"mode": mode, "transactional_id": "tid-1"})
    h = Harness(monkeypatch, cfg, metrics=m, model=FakeModel(output=lambda x: complex(x, 1))).start()
    h.c.assign(("in", 0))
    h.send(3)
    h.process()
    h.commit()
    assert [r["status"] for r in h.p.results()] == ["error"] * 3
    assert value(m, "kiw_records_out_total", lane="default", status="error") == 3
    assert value(m, "kiw_dlq_total", stage="output") == 3
    st = h.runner.stats
    assert (st.results_ok, st.results_error, st.dlq) == (0, 3, 3)


def test_records_at_offsets_the_position_moved_back_to_are_processed(monkeypatch: pytest.MonkeyPatch) -> None:
    """librdkafka may move the position back without a rebalance (log truncation after an unclean leader
    election, a topic deleted and recreated): the records at those offsets are new data. A guard meant for
    exactly-once rewinds skipped them in at-least-once mode too, and the commit passed them."""
    h = Harness(monkeypatch).start()
    h.c.assign(("in", 0))
    h.send(5)
    h.process()
    h.commit()
    assert h.committed() == 5
    h.c.logs[IN0] = h.c.logs[IN0][:3]  # truncated to 3 records; new records at 3, 4, 5
    h.send(3)
    h.c.positions[IN0] = 3
    n = len(h.result_ids())
    h.process()
    h.process()
    h.commit()
    assert h.result_ids()[n:] == ["in-0-3", "in-0-4", "in-0-5"] and h.committed() == 6
