"""Runner rebalance callbacks: on revoke, queued records of the revoked partitions
are dropped (the new owner reprocesses them), records already on a device get ``revoke_timeout_ms`` to
finish and be delivered, the done prefix is committed synchronously inside the callback, and anything of
those partitions that completes later is neither produced nor acked (assignment epochs). On loss nothing
is committed. No exception ever escapes a rebalance callback."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from tests.unit.fakes_kafka import Harness, make_config
from worker.core.records import Batch, TopicPartition
from worker.observability.metrics import PrometheusMetrics

IN0, IN1 = TopicPartition("in", 0), TopicPartition("in", 1)
REVOKE_S = 0.2  # delivery.revoke_timeout_ms in make_config


def offsets_out(h: Harness, partition: int = 0) -> list[int]:
    return [r["source"]["offset"] for r in h.p.results() if r["source"]["partition"] == partition]


def reading_two(monkeypatch: pytest.MonkeyPatch, n: int) -> Harness:
    """A runner assigned in/0 and in/1 that has read ``n`` records of each."""
    h = Harness(monkeypatch).start()
    h.c.assign(("in", 0), ("in", 1))
    h.send(n, partition=0)
    h.send(n, partition=1)
    h.iterate()
    return h


def on_device(h: Harness, n: int, partition: int = 0) -> Batch:
    """``n`` more records of ``partition``, read; the batch of them the device took (and holds)."""
    h.send(n, partition=partition)
    h.iterate()
    batch = h.device.take()
    assert batch is not None
    return batch


def test_queued_records_of_revoked_partitions_are_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    h = reading_two(monkeypatch, 3)
    assert len(h.runner.scheduler) == 6
    t0 = h.clock.t
    h.c.revoke(("in", 0))
    assert h.clock.t - t0 < REVOKE_S  # nothing of in/0 was on a device: no waiting
    assert len(h.runner.scheduler) == 3 and h.runner.tracker.in_flight() == 3
    assert IN0 not in h.runner.assigned
    h.device.run_all()
    h.iterate()
    h.commit()
    assert offsets_out(h, 0) == [] and offsets_out(h, 1) == [0, 1, 2]
    assert h.c.commit_calls == [{IN1: 3}]


def test_in_device_records_get_revoke_timeout_and_the_done_prefix_is_committed_in_the_callback(
        monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch).start()
    h.c.assign(("in", 0))
    batch = on_device(h, 3)
    h.send(2)  # 3 and 4: fetched while the batch runs, still queued at revoke
    h.iterate()
    polls = []

    def device_finishes_during_the_wait() -> None:
        polls.append(h.clock.t)
        if len(polls) == 3:
            h.device.finish(batch)

    h.p.hooks.append(device_finishes_during_the_wait)
    commits_inside: list[bool] = []
    real_commit = h.c.commit

    def commit(*a: object, **kw: object) -> object:
        commits_inside.append(IN0 in h.c.assignment_set and kw.get("asynchronous") is False)
        return real_commit(*a, **kw)  # type: ignore[arg-type]

    h.c.commit = commit  # type: ignore[method-assign]
    t0 = h.clock.t
    h.c.revoke(("in", 0))
    assert h.clock.t - t0 < REVOKE_S  # returned as soon as the device's records were delivered
    assert offsets_out(h) == [0, 1, 2]  # finished inside the callback: produced and delivered
    assert h.committed() == 3  # the done prefix, before the queued 3 and 4
    assert commits_inside == [True]  # synchronous, while the partition was still ours


def test_records_still_on_the_device_after_revoke_timeout_are_dropped_and_never_produced(
        monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch).start()
    h.c.assign(("in", 0))
    h.device.finish(on_device(h, 2))
    h.iterate()  # 0, 1 delivered (not committed yet: interval)
    slow = on_device(h, 2)  # 2, 3: on the device and they stay there
    t0 = h.clock.t
    h.c.revoke(("in", 0))
    assert REVOKE_S <= h.clock.t - t0 < REVOKE_S + 0.1
    assert h.committed() == 2
    assert h.runner.tracker.in_flight() == 0
    h.device.finish(slow)  # the late outputs of the revoked partition
    h.iterate()
    h.commit()
    assert offsets_out(h) == [0, 1] and len(h.p.produced) == 2
    assert h.runner.stats.results_ok == 2
    assert h.c.commit_calls == [{IN0: 2}]


def test_late_outputs_of_an_old_assignment_do_not_ack_the_new_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Revoked and assigned again (cooperative rebalance): the old epoch's batch finishing now must not
    produce or ack the same offsets, which the new epoch reads again from the committed offset."""
    h = Harness(monkeypatch).start()
    h.c.assign(("in", 0))
    old = on_device(h, 3)
    h.c.revoke(("in", 0))
    h.c.assign(("in", 0))  # nothing was committed: read again from 0
    h.iterate()
    assert h.runner.tracker.pending(IN0) == 3
    h.device.finish(old)  # old epoch: dropped
    h.iterate()
    h.commit()
    assert h.p.produced == [] and h.c.commit_calls == []
    h.device.run_all()  # the new epoch's records
    h.iterate()
    h.commit()
    assert offsets_out(h) == [0, 1, 2] and h.committed() == 3


def test_delivery_reports_arriving_after_revoke_do_not_ack(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch).start()
    h.c.assign(("in", 0))
    h.send(3)
    h.iterate()
    h.device.run_all()
    h.p.hold = True
    h.iterate()  # produced; the broker has not answered
    h.c.revoke(("in", 0))  # waits revoke_timeout for the reports, in vain; commits nothing
    assert h.c.commit_calls == []
    h.c.assign(("in", 0))
    h.iterate()  # the new epoch reads 0..2 again
    h.p.hold = False
    h.iterate()  # the old reports arrive now
    h.commit()
    assert h.c.commit_calls == []  # the new epoch's 0..2 are not done
    assert h.runner.tracker.pending(IN0) == 3


def test_lost_partitions_commit_nothing_and_drop_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    h = reading_two(monkeypatch, 2)
    b = h.device.take()
    assert b is not None
    h.device.finish(b)
    h.iterate()  # everything delivered, nothing committed yet
    t0 = h.clock.t
    h.c.lose(("in", 0))
    assert h.clock.t - t0 < REVOKE_S  # no grace period: the partitions belong to someone else already
    assert h.c.commit_calls == []
    assert h.runner.assigned == {IN1}
    h.commit()
    assert h.c.commit_calls == [{IN1: 2}]


def test_close_revokes_like_the_real_client(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch).start()
    h.c.assign(("in", 0))
    h.send(2)
    h.process()
    h.runner.close()
    assert h.c.closed and h.committed() == 2
    assert h.runner.assigned == set()


# ------------------------------------------------------------------------------ exceptions in callbacks
def test_on_assign_errors_never_escape(monkeypatch: pytest.MonkeyPatch,
                                       caplog: pytest.LogCaptureFixture) -> None:
    def broken(consumer: object, partitions: object) -> None:
        raise RuntimeError("user on_assign_offsets bug")

    h = Harness(monkeypatch, on_assign_offsets=broken).start()
    with caplog.at_level(logging.ERROR, logger="worker.runner"):
        h.c.assign(("in", 0))  # would raise out of consume() in the real client
    assert "error in on_assign" in caplog.text
    assert h.runner.assigned == {IN0}  # the assignment itself is recorded
    h.send(1)
    h.iterate()
    assert h.runner.stats.records_in == 1


def test_on_revoke_and_on_lost_errors_never_escape(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    h = Harness(monkeypatch).start()
    h.c.assign(("in", 0), ("in", 1))
    h.send(1, partition=0)
    h.send(1, partition=1)
    h.process()
    h.c.commit_failures.append(RuntimeError("not even a KafkaException"))

    def flush_fails(timeout: float | None = None) -> int:
        raise KafkaException(KafkaError(KafkaError._TRANSPORT, "broker went away"))

    h.p.flush = flush_fails  # type: ignore[method-assign]
    with caplog.at_level(logging.ERROR, logger="worker.runner"):
        h.c.revoke(("in", 0))
        h.runner.dispatch.scheduler = None  # type: ignore[assignment]  # anything inside on_lost blows up now
        h.c.lose(("in", 1))
    assert "error in on_revoke" in caplog.text and "error in on_lost" in caplog.text


def test_an_error_during_revoke_still_releases_the_partitions(monkeypatch: pytest.MonkeyPatch) -> None:
    """Whatever fails while waiting for the device or committing, the partitions are gone when the callback
    returns: their queued records must not stay counted in flight (they never complete, so backpressure
    would pause the worker for good) and their late outputs must not be produced."""
    cfg = make_config(batching={"max_in_flight": 4, "resume_ratio": 0.5})
    h = Harness(monkeypatch, cfg).start()
    h.c.assign(("in", 0), ("in", 1))
    on_dev = on_device(h, 1)
    h.send(3, partition=0)
    h.iterate()  # 4 in flight (1 on the device, 3 queued): in/0 pauses (in/1 has returned nothing yet)
    assert h.c.paused == {IN0}

    def flush_fails(timeout: float | None = None) -> int:
        raise KafkaException(KafkaError(KafkaError._TRANSPORT, "broker went away"))

    real_flush = h.p.flush
    h.p.flush = flush_fails  # type: ignore[method-assign]
    h.c.revoke(("in", 0))  # the error is swallowed (logged)
    h.p.flush = real_flush  # type: ignore[method-assign]
    h.device.finish(on_dev)  # a late output of the revoked partition
    h.send(3, partition=1)
    for _ in range(3):
        h.iterate()
        h.device.run_all()
    # the worker goes on with in/1: not paused for good by the 3 dropped records of in/0
    assert h.c.paused & set(h.c.assignment_set) == set() and offsets_out(h, 1) == [0, 1, 2]
    assert offsets_out(h, 0) == []  # the late output was not produced
    assert IN0 not in h.runner.assigned and h.runner.tracker.in_flight() == 0


def test_a_released_partitions_lag_series_is_removed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A gauge keeps its last value per label set: without removal, a revoked or lost partition's lag stayed
    on /metrics (and in the summed lag an autoscaler reads) for the life of the process."""
    from prometheus_client.parser import text_string_to_metric_families

    from worker.observability.metrics import PrometheusMetrics

    m = PrometheusMetrics()

    def lag_series() -> set[tuple[str, str]]:
        return {(s.labels["topic"],
                 s.labels["partition"]) for f in text_string_to_metric_families(m.render().decode())
                if f.name == "kiw_consumer_lag" for s in f.samples}

    h = Harness(monkeypatch, metrics=m).start()
    h.c.assign(("in", 0), ("in", 1), ("in", 2))
    for p in range(3):
        h.send(2, partition=p)
    h.iterate()  # the first turn reports the lag
    assert lag_series() == {("in", "0"), ("in", "1"), ("in", "2")}
    h.c.revoke(("in", 0))
    assert lag_series() == {("in", "1"), ("in", "2")}
    h.c.lose(("in", 1))
    assert lag_series() == {("in", "2")}


def test_a_refused_message_inside_a_revoke_stops_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    # Serving results inside the revoke callback can raise FatalDeliveryError (the producer refuses a
    # message); the callback logged it and the worker went on, where a loop turn would have stopped it.
    from worker.output.emit import FatalDeliveryError

    h = Harness(monkeypatch).start()
    h.c.assign(("in", 0))
    real = h.runner.membership.release
    calls: list[bool] = []

    def release(tps: Any, graceful: bool) -> None:
        calls.append(graceful)
        if graceful:
            raise FatalDeliveryError("cannot produce to 'out' (kafka.output_topic): Broker: "
                                     "Message size too large")
        real(tps, graceful)

    monkeypatch.setattr(h.runner.membership, "release", release)
    h.c.revoke(("in", 0))
    assert calls == [True, False]  # still released: the partition is gone whatever failed
    assert "Message size too large" in (h.runner.fatal or "")


def process_all(h: Harness, turns: int = 6) -> None:
    """Loop turns with the device emptied after each, then a commit."""
    for _ in range(turns):
        h.iterate()
        h.device.run_all()
    h.iterate()
    h.commit()


def test_a_partition_paused_when_revoked_is_read_again_when_assigned_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """librdkafka keeps a partition's pause through a revoke and a new assign. Paused under backpressure when
    a rebalance took it, the partition came back paused, while the runner had forgotten that pause: this
    worker never read it again (scale-out under load, then scale-in)."""
    h = Harness(monkeypatch, make_config(batching={"max_in_flight": 4, "resume_ratio": 0.5})).start()
    h.c.assign(("in", 0))
    h.send(6)
    h.iterate()
    assert h.c.paused == {IN0}  # 4 in flight: the bound
    h.c.revoke(("in", 0))
    h.c.assign(("in", 0))
    process_all(h)
    assert offsets_out(h) == [0, 1, 2, 3, 4, 5] and h.committed() == 6


def test_backfill_partition_read_to_its_end_then_revoked_is_read_again_from_its_commit(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A backfill pauses a partition read up to its end snapshot. Revoked before its records were processed
    (they are dropped) and assigned again, it has to be read again: kept "reached", it was paused at once and
    the backfill waited for it for good."""
    h = Harness(monkeypatch, make_config(kafka={"poll_max_records": 2}), stop_at={IN0: 6}).start()
    h.c.assign(("in", 0))
    h.send(6)
    h.iterate(3)  # 2 records a turn
    assert IN0 in h.runner.reached and h.runner.tracker.in_flight() == 6
    h.c.revoke(("in", 0))  # nothing was on a device: all 6 dropped, nothing committed
    assert h.committed() is None
    h.c.assign(("in", 0))
    process_all(h)
    assert offsets_out(h) == [0, 1, 2, 3, 4, 5] and h.committed() == 6
    assert h.runner.loop.backfill_complete()


def test_an_assign_hook_that_raises_still_leaves_the_partitions_resumed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The start-offsets hook (backfill's) raised once for a partition it did not know; the pause or resume
    that follows it was skipped, and a partition paused when it was revoked stayed paused in the client for
    good."""
    def hook(consumer: object, partitions: list[object]) -> None:
        raise KeyError("in[1]")

    h = Harness(monkeypatch, make_config(batching={"max_in_flight": 4, "resume_ratio": 0.5}),
                on_assign_offsets=hook).start()
    h.c.assign(("in", 0))
    h.send(6)
    h.iterate()
    assert h.c.paused == {IN0}
    h.c.revoke(("in", 0))
    h.c.assign(("in", 0))
    assert h.c.paused == set()
    process_all(h)
    assert offsets_out(h) == [0, 1, 2, 3, 4, 5]


# ---------------------------------------------------------------------------- a lost partition comes back
def lose_delivered(h: Harness, delivered: int, held: int = 0) -> None:
    """in/0: record 0 processed and committed; then ``delivered`` more processed and delivered (not
    committed), then ``held`` more processed whose results the broker has not acknowledged yet; then the
    partition is
    lost."""
    h.c.assign(("in", 0))
    h.send(1)
    h.process()
    h.commit()
    h.send(delivered)
    h.process()
    if held:
        h.send(held)
        h.iterate()
        h.device.run_all()
        h.p.hold = True
        h.iterate()  # produced; not acknowledged
    assert h.c.commit_calls == [{IN0: 1}]
    h.c.lose(("in", 0))
    h.c.commit_calls.clear()


def test_a_lost_partition_that_comes_back_goes_on_after_what_was_delivered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    metrics = PrometheusMetrics()
    h = Harness(monkeypatch, metrics=metrics).start()
    lose_delivered(h, 4)
    h.send(2)  # 5 and 6: new since
    h.c.assign(("in", 0))  # the group's commit is still 1: reading would start there
    assert h.c.commit_calls == [{IN0: 5}]  # committed inside the callback, before the fetch starts
    assert metrics.lost_records_skipped_total._value.get() == 4
    h.process()
    h.commit()
    assert offsets_out(h) == [0, 1, 2, 3, 4, 5, 6]  # nothing processed twice
    assert h.committed() == 7


def test_results_delivered_after_the_loss_count_too(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch).start()
    lose_delivered(h, 2, held=3)
    h.p.hold = False
    h.iterate()  # the broker answers: 3..5 are delivered, their partition gone meanwhile
    h.c.assign(("in", 0))
    assert h.c.commit_calls == [{IN0: 6}]
    h.process()
    assert offsets_out(h) == [0, 1, 2, 3, 4, 5]


def test_lost_before_the_first_commit_it_goes_on_after_what_was_delivered(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = Harness(monkeypatch).start()
    h.c.assign(("in", 0))
    h.send(3)
    h.process()
    h.c.lose(("in", 0))
    h.send(1)
    h.c.assign(("in", 0))  # the group has no commit: reading would start at auto.offset.reset (earliest)
    assert h.c.commit_calls == [{IN0: 3}]
    h.process()
    assert offsets_out(h) == [0, 1, 2, 3]


def test_without_a_commit_a_partition_that_no_longer_holds_what_was_read_is_read_from_the_start(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # The topic deleted and created again while the partition was away: its offsets are other records now.
    h = Harness(monkeypatch).start()
    h.c.assign(("in", 0))
    h.send(3)
    h.process()
    h.c.lose(("in", 0))
    h.c.logs[IN0].clear()
    h.send(2)  # the new topic's records 0 and 1; this worker delivered up to 3 of the old one
    h.c.assign(("in", 0))
    assert h.c.commit_calls == []
    h.process()
    assert h.result_ids() == ["in-0-0", "in-0-1", "in-0-2", "in-0-0", "in-0-1"]


def test_a_commit_outside_what_this_worker_delivered_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch).start()
    lose_delivered(h, 4)
    h.c.committed_offsets[IN0] = 7  # another member processed past it meanwhile
    h.send(4)
    h.c.assign(("in", 0))
    assert h.c.commit_calls == []
    h.process()
    assert offsets_out(h) == [0, 1, 2, 3, 4, 7, 8]


def test_an_offset_reset_below_what_this_worker_read_is_honoured(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch).start()
    lose_delivered(h, 4)  # this assignment read from 0
    h.c.lose(("in", 0))
    h.c.assign(("in", 0))  # back at 1: 1..4 skipped
    h.send(2)
    h.process()  # 5, 6
    h.c.lose(("in", 0))  # this assignment read from 5
    h.c.committed_offsets[IN0] = 2  # an operator rewound the group to 2, below that
    h.c.commit_calls.clear()
    h.c.assign(("in", 0))
    assert h.c.commit_calls == []
    h.process()
    assert offsets_out(h) == [0, 1, 2, 3, 4, 5, 6, 2, 3, 4, 5, 6]


def test_a_revoked_partition_keeps_nothing_and_only_the_next_assignment_uses_a_lost_one(
        monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch).start()
    h.c.assign(("in", 0), ("in", 1))
    h.send(1, partition=1)
    h.process()
    h.commit()
    h.send(2, partition=0)
    h.send(2, partition=1)
    h.process()
    h.c.revoke(("in", 0))  # committed in the callback; nothing kept
    h.c.lose(("in", 1))
    assert h.runner.tracker.lost() == [IN1]
    h.c.commit_calls.clear()
    h.c.assign(("in", 0))  # the rejoin's assignment, without in/1 (another member has it now): dropped
    assert h.runner.tracker.lost() == []
    h.c.assign(("in", 1))  # back later: from the group's commit
    assert h.c.commit_calls == []
    h.process()
    assert offsets_out(h, 1) == [0, 1, 2, 1, 2]


def test_reading_the_commits_fails_then_the_partition_is_read_from_its_commit(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    h = Harness(monkeypatch).start()
    lose_delivered(h, 3)

    def no_broker(*a: Any, **kw: Any) -> Any:
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "timed out"))

    monkeypatch.setattr(h.c, "committed", no_broker)
    with caplog.at_level(logging.WARNING, logger="worker.runner"):
        h.c.assign(("in", 0))
    assert "their commits could not be read" in caplog.text
    assert h.c.commit_calls == [] and h.runner.tracker.lost() == []
    assert h.runner.assigned == {IN0}
    h.process()
    assert offsets_out(h) == [0, 1, 2, 3, 1, 2, 3]  # at-least-once as before: processed again


def test_a_replaced_consumer_goes_on_after_what_was_delivered(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch).start()
    h.c.assign(("in", 0))
    h.send(1)
    h.process()
    h.commit()
    h.send(3)
    h.process()
    h.runner.membership.replace_consumer(h.clock.t)  # out of the group too long: released without a commit
    assert h.c is not h.consumers[0] and h.runner.tracker.lost() == [IN0]
    h.c.assign(("in", 0))
    assert h.c.commit_calls[-1] == {IN0: 4}
    h.send(1)
    h.process()
    assert offsets_out(h) == [0, 1, 2, 3, 4]


def test_exactly_once_keeps_nothing_of_a_lost_partition(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch, make_config(delivery={"mode": "exactly_once", "transactional_id": "t"})).start()
    h.c.assign(("in", 0))
    h.send(3)
    h.process()
    h.c.lose(("in", 0))  # the transaction holding 0..2 is aborted
    assert h.runner.tracker.lost() == []


def test_the_reads_of_a_lost_partition_share_one_deadline(monkeypatch: pytest.MonkeyPatch) -> None:
    # Inside the assign callback the loop stands still: a slow broker must not hold it 5 s per partition.
    h = Harness(monkeypatch).start()
    h.c.assign(("in", 0))
    h.send(3)
    h.process()
    h.c.lose(("in", 0))
    real = h.c.committed

    def slow(partitions: list[Any], timeout: float | None = None) -> Any:
        h.clock.t += 5.0  # the whole allowance spent on the first read
        return real(partitions, timeout)

    monkeypatch.setattr(h.c, "committed", slow)
    h.c.watermark_queries.clear()
    h.c.assign(("in", 0))  # no commit: the log would have to be read too, and there is no time left
    assert h.c.commit_calls == [] and h.c.watermark_queries == []
