"""Runner, exactly-once mode (worker/output/transactions.py): results are produced per
partition in offset order (reorder buffer), each checkpoint sends the offsets of exactly the produced and
delivered prefix to the transaction, and a failed commit aborts, rewinds the consumer to the committed
offsets and ignores the aborted attempt's late delivery reports. A read_committed reader sees every
result once."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from tests.unit.fakes_kafka import Harness, make_config, request
from worker.core.records import TopicPartition

IN0, IN1 = TopicPartition("in", 0), TopicPartition("in", 1)
LANES = {"lanes": [{"name": "hi", "priority": 1, "fill_with_lower": False}, {"name": "lo"}],
         "default_lane": "lo"}


def eos(monkeypatch: pytest.MonkeyPatch, devices: int = 1, **sections: dict[str, Any]) -> Harness:
    sections.setdefault("delivery", {})
    sections["delivery"] = {"mode": "exactly_once", "transactional_id": "tid-1", **sections["delivery"]}
    return Harness(monkeypatch, make_config(**sections), devices=devices).start()


def abortable(msg: str = "transaction failed") -> KafkaException:
    """A commit error that requires an abort (a retriable one without that is retried:
    test_runner_txn_errors)."""
    return KafkaException(KafkaError(KafkaError._INCONSISTENT, msg, txn_requires_abort=True))


def src(p: Any) -> tuple[int, int]:
    s = p.json()["source"]
    return s["partition"], s["offset"]


def check_transactions(h: Harness) -> None:
    """Every committed transaction holds only results inside the offset prefix committed with it (and
    before), and a read_committed reader sees each source record's result once."""
    committed: dict[TopicPartition, int] = {}
    txn = 0
    offsets_in_txn: dict[TopicPartition, int] = {}
    for call in h.p.txn_calls:
        if call[0] == "begin":
            txn += 1
            offsets_in_txn = {}
        elif call[0] == "send_offsets":
            offsets_in_txn.update(call[1])
        elif call[0] == "commit" and txn in h.p.committed_txns:
            committed.update(offsets_in_txn)
            for p in h.p.delivered:
                if p.txn == txn and p.topic == "out":
                    part, off = src(p)
                    assert off < committed.get(TopicPartition("in", part), 0), (
                        f"txn {txn} commits the result of in[{part}]@{off} past its committed offset")
    seen = Counter(src(p) for p in h.p.visible("out"))
    assert all(n == 1 for n in seen.values()), f"results seen twice: {[k for k, n in seen.items() if n > 1]}"


def test_results_are_produced_in_offset_order_when_lanes_finish_out_of_order(
        monkeypatch: pytest.MonkeyPatch) -> None:
    h = eos(monkeypatch, devices=2, batching=LANES)
    h.c.assign(("in", 0))
    for i, lane in enumerate(["lo", "hi", "lo", "hi", "hi"]):
        h.c.append("in", 0, request(f"r{i}", i, priority=lane))
    h.iterate()
    hi, lo = h.device.take(), h.devices[1].take()
    assert hi is not None and lo is not None and hi.lane == "hi"
    h.device.finish(hi)
    h.iterate()
    assert h.p.produced == []  # 1, 3, 4 wait in the reorder buffer for 0
    h.commit()
    assert h.p.txn_offsets() == []  # nothing produced: no offsets in that transaction
    h.devices[1].finish(lo)
    h.iterate()
    assert [src(p)[1] for p in h.p.produced] == [0, 1, 2, 3, 4]
    h.commit()
    assert h.p.txn_offsets() == [{IN0: 5}]
    assert [r["id"] for r in h.p.results()] == ["r0", "r1", "r2", "r3", "r4"]
    assert h.c.commit_calls == []  # offsets go through the transaction, never consumer.commit
    check_transactions(h)


def test_checkpoint_sends_the_offsets_of_the_produced_prefix_only(monkeypatch: pytest.MonkeyPatch) -> None:
    h = eos(monkeypatch, devices=2, batching=LANES)
    h.c.assign(("in", 0), ("in", 1))
    for i, lane in enumerate(["hi", "hi", "lo", "hi"]):
        h.c.append("in", 0, request(f"a{i}", i, priority=lane))
    h.send(2, partition=1)
    h.iterate()
    hi = h.device.take()
    assert hi is not None and {(r.tp, r.offset) for r in hi.records} == {(IN0, 0), (IN0, 1), (IN0, 3)}
    h.device.finish(hi)
    h.iterate()
    h.commit()
    assert h.p.txn_offsets() == [{IN0: 2}]  # 3 is done but waits behind 2; in/1 not started
    lo = h.device.take()
    assert lo is not None
    h.device.finish(lo)
    h.iterate()
    h.commit()
    assert h.p.txn_offsets() == [{IN0: 2}, {IN0: 4, IN1: 2}]
    assert [c[0] for c in h.p.txn_calls] == ["init", "begin", "send_offsets", "commit", "begin",
                                             "send_offsets", "commit", "begin"]
    check_transactions(h)


def test_aborted_transaction_rewinds_to_the_committed_offsets_and_ignores_stale_reports(
        monkeypatch: pytest.MonkeyPatch) -> None:
    h = eos(monkeypatch)
    h.c.assign(("in", 0))
    h.send(2)
    h.process()
    h.commit()  # txn 1: results 0, 1 and offset 2
    assert h.p.txn_offsets() == [{IN0: 2}]
    h.send(3)
    h.iterate()
    h.device.run_all()
    h.p.hold = True  # the broker stops answering: the results of 2..4 stay undelivered
    h.iterate()
    h.commit()  # flush times out, commit_transaction times out -> abort -> rewind
    assert ("abort",) in h.p.txn_calls and h.runner.mode.txn is not None and h.runner.mode.txn.aborts == 1
    assert h.c.seek_calls == [(IN0, 2)]  # back to the committed offset
    assert h.runner.tracker.in_flight() == 0
    h.p.hold = False
    produced_before = len(h.p.produced)
    h.iterate()  # purge reports of the aborted results arrive: stale, not retried; 2..4 read again
    h.device.run_all()
    h.iterate()
    h.iterate()
    h.commit()
    assert len(h.p.produced) == produced_before + 3  # one new result each, no stale re-send
    assert [r["source"]["offset"] for r in h.p.results()] == [0, 1, 2, 3, 4]
    assert h.p.txn_offsets()[-1] == {IN0: 5}
    assert h.runner.fatal is None
    check_transactions(h)


def test_an_injected_commit_failure_aborts_and_the_records_are_redone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = eos(monkeypatch)
    h.c.assign(("in", 0))
    h.send(3)
    h.process()
    h.p.fail_txn("commit", abortable("coordinator moved"))
    h.commit()
    assert h.runner.mode.txn is not None and h.runner.mode.txn.aborts == 1
    assert h.p.results() == []  # the aborted transaction's results are invisible
    h.process()
    h.commit()
    assert [r["id"] for r in h.p.results()] == ["in-0-0", "in-0-1", "in-0-2"]
    check_transactions(h)


def test_revoke_commits_the_transaction_and_drops_the_partition(monkeypatch: pytest.MonkeyPatch) -> None:
    h = eos(monkeypatch)
    h.c.assign(("in", 0), ("in", 1))
    h.send(2, partition=0)
    h.send(2, partition=1)
    h.process()
    h.send(2, partition=0)
    h.iterate()
    late = h.device.take()  # in/0 @2, 3 on the device when in/0 is revoked
    assert late is not None and {r.tp for r in late.records} == {IN0}
    h.c.revoke(("in", 0))
    assert h.p.txn_offsets() == [{IN0: 2, IN1: 2}]  # one transaction: every produced result + offsets
    assert h.p.txn_calls[-2:] == [("commit",), ("begin",)]
    h.device.finish(late)
    h.iterate()
    h.commit()
    assert sorted(src(p) for p in h.p.visible("out")) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    check_transactions(h)


def test_revoke_does_not_wait_for_results_that_can_never_be_produced(monkeypatch: pytest.MonkeyPatch) -> None:
    """in[0]@0 (low lane) is still queued and dropped at revoke; @1 (high lane) is finished but waits in the
    reorder buffer for @0, so it can never be produced: the rebalance callback must not sit out
    revoke_timeout_ms (5 s here) for it while the whole group waits."""
    h = eos(monkeypatch, batching=LANES, delivery={"revoke_timeout_ms": 5000})
    h.c.assign(("in", 0), ("in", 1))
    h.c.append("in", 0, request("a", 0, priority="lo"))
    h.c.append("in", 0, request("b", 1, priority="hi"))
    h.iterate()
    hi = h.device.take()
    assert hi is not None and [r.offset for r in hi.records] == [1]
    h.device.finish(hi)
    h.iterate()
    t0 = h.clock.t
    h.c.revoke(("in", 0))
    assert h.clock.t - t0 < 1.0, f"the revoke callback waited {h.clock.t - t0:.1f} s"
    assert h.p.produced == [] and h.runner.tracker.in_flight() == 0


def test_fenced_producer_stops_the_worker_with_exit_1(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch, make_config(kafka={"commit_interval_ms": 50},
                                         delivery={"mode": "exactly_once", "transactional_id": "tid-1"}))
    h.send(3)
    h.c.schedule(lambda: h.c.assign(("in", 0)))
    h.device.auto = True
    h.c.hooks.append(h.device.hook)
    h.p.hooks.append(lambda: h.p.fence() if h.p.delivered else None)
    assert h.run() == 1
    assert "fenced" in (h.runner.fatal or "").lower()
    assert h.p.committed_txns == set() and h.p.results() == []
    assert h.c.closed and h.c.commit_calls == []


def test_metrics_count_every_result_by_lane_and_status_on_the_general_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """In exactly-once mode every result goes through the general path, which adds its metrics once per lane
    and status: the totals are those of one count and one latency per record."""
    from tests.unit.fakes_kafka import FakeModel
    from tests.unit.test_metrics import value
    from worker.observability.metrics import PrometheusMetrics

    m = PrometheusMetrics()
    cfg = make_config(batching=LANES, delivery={"mode": "exactly_once", "transactional_id": "tid-1"})
    h = Harness(monkeypatch, cfg, metrics=m,
                model=FakeModel(output=lambda x: ValueError("bad") if x == 2 else {"echo": x})).start()
    h.c.assign(("in", 0))
    for i, lane in enumerate(["lo", "hi", "lo", "hi", "lo"]):
        h.c.append("in", 0, request(f"r{i}", i, priority=lane), timestamp_ms=1_000 + i)
    h.process()
    assert value(m, "kiw_records_out_total", lane="lo", status="ok") == 2
    assert value(m, "kiw_records_out_total", lane="lo", status="error") == 1
    assert value(m, "kiw_records_out_total", lane="hi", status="ok") == 2
    assert value(m, "kiw_end_to_end_seconds_count", lane="lo") == 3
    assert value(m, "kiw_end_to_end_seconds_count", lane="hi") == 2


# ------------------------------------------------------------------ partitions that change hands mid-flight
@pytest.mark.parametrize("how", ["revoke-and-back", "rewind"])
def test_a_batch_taken_before_its_partition_changed_hands_leaves_no_stale_outcome(
        monkeypatch: pytest.MonkeyPatch, how: str) -> None:
    """A device took records 0..2, then the partition was revoked and assigned back (or the transaction
    aborted and the consumer rewound); the records' deadlines pass before the device starts the batch. Their
    expiry used to be emitted: it took the re-read records' places in the reorder buffer, the real results
    waited behind it forever and the partition never committed again."""
    h = eos(monkeypatch, delivery={"revoke_timeout_ms": 200},
            batching={"lanes": [{"name": "default", "deadline_ms": 1000, "max_wait_ms": 0}]})
    h.c.assign(("in", 0))
    h.send(3)
    h.iterate()
    taken = h.device.take()
    assert taken is not None and len(taken.records) == 3
    if how == "rewind":
        h.p.fail_txn("commit", abortable())
        h.commit()
    else:
        h.c.revoke(("in", 0))
        h.clock.advance(0.3)
        h.c.assign(("in", 0))
    h.clock.advance(1.5)  # the old records' deadlines pass
    swapped = h.runner.dispatch.swap(taken)
    assert swapped is not None and swapped.records == []  # not expired, not requeued, not run: not ours
    h.device.finish(swapped, [])
    for _ in range(5):
        h.process()
    h.commit()
    assert [(src(p), p.json()["status"]) for p in h.p.visible("out")] == [((0, i), "ok") for i in range(3)]
    assert h.committed() == 3 and h.p.visible("dlq") == []
    check_transactions(h)


def test_lost_partitions_abort_the_open_transaction(monkeypatch: pytest.MonkeyPatch) -> None:
    """Results of a lost partition sat in the open transaction; the next checkpoint committed them without
    their offsets, and the new owner produced them again: a read_committed reader saw them twice."""
    h = eos(monkeypatch)
    h.c.assign(("in", 0), ("in", 1))
    h.send(3, partition=0)
    for _ in range(3):
        h.process()
    h.c.lose(("in", 0))  # the new owner starts from in[0]'s last commit (none)
    h.send(2, partition=1)
    for _ in range(3):
        h.process()
    h.commit()
    assert [src(p) for p in h.p.visible("out")] == [(1, 0), (1, 1)]
    assert h.committed("in", 0) is None and h.committed("in", 1) == 2
    check_transactions(h)


def test_a_checkpoint_whose_results_are_not_all_delivered_aborts(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checkpoint's flush timed out with results outstanding; commit_transaction then delivered and
    committed them, but not the offsets that cover them (a revoke handed the partition over as it was)."""
    h = eos(monkeypatch)
    h.c.assign(("in", 0))
    h.send(3)
    h.p.hold = True  # the broker takes its time: still unacknowledged after the checkpoint's flush
    h.process()
    commit = h.p.commit_transaction

    def acks_arrive_inside_commit(timeout: float | None = None) -> None:
        h.p.hold = False
        commit(timeout)

    h.p.commit_transaction = acks_arrive_inside_commit  # type: ignore[method-assign]
    h.c.revoke(("in", 0))
    assert h.p.visible("out") == [] and h.committed() is None  # aborted: the new owner does all three
    check_transactions(h)


# ------------------------------------------------------------------ a delivery that fails inside a
# transaction
def test_a_failed_delivery_aborts_the_transaction_and_the_records_are_redone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """librdkafka puts a transaction with a failed delivery in an abortable state: a retry inside it is
    refused (the worker used to exit 1 on it). It aborts and reads again from the last commit instead."""
    h = eos(monkeypatch)
    h.c.assign(("in", 0))
    h.send(3)
    h.p.fail_next(1, topic="out")
    for _ in range(6):
        h.process()
    h.commit()
    assert h.runner.fatal is None
    assert any(c[0] == "abort" for c in h.p.txn_calls)
    assert [src(p) for p in h.p.visible("out")] == [(0, 0), (0, 1), (0, 2)] and h.committed() == 3
    check_transactions(h)


def test_a_delivery_that_fails_every_time_ends_the_worker_after_a_few_aborts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from worker.pipeline.runner import DELIVERY_ABORTS_MAX

    h = eos(monkeypatch)
    h.c.assign(("in", 0))
    h.send(3)
    h.p.fail_if = lambda p: (KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "Broker: Message size too large")
                             if p.topic == "out" and src(p) == (0, 1) else None)
    for _ in range(200):
        h.process()
        if h.runner.fatal:
            break
    assert h.runner.fatal is not None and "in[0]@1" in h.runner.fatal
    assert sum(c[0] == "abort" for c in h.p.txn_calls) == DELIVERY_ABORTS_MAX
    # Nothing at or past the record is visible or committed.
    assert all(src(p) < (0, 1) for p in h.p.visible("out")) and (h.committed() or 0) <= 1


# ------------------------------------------------------------------ revoke under load, rewind failure
# (review)
def _steady_load(h: Harness) -> None:
    """Other partitions' results keep arriving: every poll produces one more message and the broker
    acknowledges all but the newest, so the producer never drains; a flush (nothing new meanwhile) does."""
    p = h.p
    p.hold = True
    real_poll, real_flush = p.poll, p.flush

    def poll(timeout: float | None = None) -> Any:
        p.deliver(lambda m: True)
        p.produce("noise", b"x")
        return real_poll(timeout)

    def flush(timeout: float | None = None) -> Any:
        p.hold = False
        try:
            return real_flush(timeout)
        finally:
            p.hold = True

    p.poll, p.flush = poll, flush  # type: ignore[method-assign]


@pytest.mark.parametrize("on_device", [False, True])
def test_a_revoke_under_steady_load_does_not_wait_out_revoke_timeout(monkeypatch: pytest.MonkeyPatch,
                                                                     on_device: bool) -> None:
    # It waited for the one transactional producer to drain, which never happens while other partitions keep
    # producing: every graceful revoke took the whole revoke_timeout_ms (5 s here).
    h = Harness(monkeypatch, make_config(delivery={"mode": "exactly_once", "transactional_id": "t",
                                                   "revoke_timeout_ms": 5000})).start()
    h.c.assign(("in", 0), ("in", 1))
    h.send(3, partition=0)
    h.send(3, partition=1)
    h.process()
    late = None
    if on_device:
        h.send(2, partition=0)
        h.iterate()
        late = h.device.take()
    _steady_load(h)
    t0 = h.clock.t
    if late is not None:
        finished = []

        def finish_later() -> None:  # the device finishes in[0]@3,4 100 ms into the revoke
            if not finished and h.clock.t - t0 >= 0.1:
                finished.append(True)
                h.device.finish(late)

        h.p.hooks.append(finish_later)
    h.c.revoke(("in", 0))
    took = h.clock.t - t0
    committed = dict(h.p.group_offsets)
    h.p.hold = False
    h.process()
    h.commit()
    check_transactions(h)
    assert committed.get(IN0) == (5 if on_device else 3)
    visible = sorted(src(p) for p in h.p.visible("out"))
    assert [v for v in visible if v[0] == 0] == [(0, o) for o in range(committed[IN0])]
    assert took < 1.0


def test_a_rewind_that_cannot_seek_stops_the_worker_and_commits_nothing_more(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A checkpoint fails during a graceful revoke, the abort's rewind cannot read the committed offsets. The
    # error used to be swallowed by the rebalance callback: the kept partition went on from its fetch position
    # with nothing tracked before it, and the next checkpoint committed past results the abort discarded.
    import worker.pipeline.exactly_once as runner_mod

    h = Harness(monkeypatch, make_config(delivery={"mode": "exactly_once", "transactional_id": "t"})).start()
    real = runner_mod.retry_transient
    monkeypatch.setattr(runner_mod, "retry_transient",
                        lambda fn, *a, timeout=60, **k: real(fn, *a, timeout=0.2, **k))  # not 30 s of retries
    h.c.assign(("in", 0), ("in", 1))
    h.send(3, partition=1)
    h.send(1, partition=0)
    h.process()  # results in the open transaction, not committed yet
    h.p.fail_txn("commit", abortable("moved"))

    def committed(parts: Any, timeout: float | None = None) -> Any:
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "Local: Timed out", retriable=True))

    monkeypatch.setattr(h.c, "committed", committed)
    h.c.revoke(("in", 0))
    assert "could not rewind" in (h.runner.fatal or "")
    h.send(2, partition=1)
    h.process()
    h.commit()
    assert h.p.group_offsets.get(IN1) is None  # nothing committed past the discarded results
    assert h.p.visible("out") == []


def test_a_refused_dead_letter_aborts_the_open_transaction(monkeypatch: pytest.MonkeyPatch) -> None:
    """An invalid request with a readable id owes an error result and a dead letter. The result went into the
    open transaction, then the dead letter was refused (the DLQ topic does not exist: exit 1): the shutdown's
    checkpoint committed that transaction, so the error result was visible while its offset was not
    committed, and the restart produced it again."""
    h = Harness(monkeypatch, make_config(delivery={"mode": "exactly_once", "transactional_id": "tid-1"}))
    h.p.unknown_topics.add("dlq")
    h.send(1)  # offset 0: ok
    h.c.append("in", 0, request("bad", "x", deadline_ms="nope"))  # offset 1: invalid, id readable
    h.c.schedule(lambda: h.c.assign(("in", 0)))
    h.device.auto = True
    h.c.hooks.append(h.device.hook)
    assert h.run() == 1
    assert "dlq" in (h.runner.fatal or "")
    assert h.p.aborted_txns and not h.p.committed_txns
    # all of it is processed again after the restart
    assert h.p.visible("out") == [] and h.committed() is None
    check_transactions(h)
