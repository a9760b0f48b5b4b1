"""Runner, exactly-once recovery (worker/output/transactions.py): what an abort rewinds to and forgets, a
rewind served inside consume(), librdkafka's abortable state (produce refused with _STATE after a timed-out
message), and a commit_transaction that times out (abort and begin refused with _CONFLICT until the commit is
called again)."""

from __future__ import annotations

from collections import Counter

import pytest
from confluent_kafka import KafkaError, KafkaException

import worker.pipeline.runner as wr
from tests.unit.fakes_kafka import Harness, make_config
from worker.app.backfill import BackfillRunner
from worker.core.records import TopicPartition
from worker.timing.clock import Deadline

IN0, IN1 = TopicPartition("in", 0), TopicPartition("in", 1)
EOS = {"mode": "exactly_once", "transactional_id": "tid-1"}


def abortable() -> KafkaException:
    return KafkaException(KafkaError(KafkaError._INCONSISTENT, "transaction failed", txn_requires_abort=True))


def timed_out() -> KafkaException:
    return KafkaException(KafkaError(KafkaError._TIMED_OUT, "EndTxn timed out", retriable=True))


def sources(h: Harness) -> list[tuple[int, int]]:
    return [(r["source"]["partition"], r["source"]["offset"]) for r in h.p.results()]


# ------------------------------------------------------------------ backfill: an abort un-reaches the end
def backfill(monkeypatch: pytest.MonkeyPatch) -> Harness:
    monkeypatch.setattr(wr, "Runner", BackfillRunner)
    h = Harness(monkeypatch, make_config(delivery=EOS), stop_at={IN0: 3})
    h.send(3)
    h.c.schedule(lambda: h.c.assign(("in", 0)))
    h.device.auto = True
    h.c.hooks.append(h.device.hook)
    return h


def test_backfill_goes_on_after_an_abort_that_follows_its_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """The abort's rewind cleared the tracker but not ``reached``: the backfill counted itself complete right
    after the abort and exited 0 with none of the aborted results ever produced again."""
    h = backfill(monkeypatch)
    h.p.fail_next(1, topic="out")  # one result's delivery fails: abort + rewind
    assert h.run() == 0
    assert sorted(sources(h)) == [(0, 0), (0, 1), (0, 2)] and h.committed() == 3
    assert IN0 in h.runner.finished


def test_backfill_whose_last_checkpoint_aborts_is_not_finished(monkeypatch: pytest.MonkeyPatch) -> None:
    h = backfill(monkeypatch)
    h.p.fail_txn("commit", abortable())  # the shutdown's checkpoint
    h.run()
    assert h.p.results() == [] and h.committed() is None
    assert IN0 not in h.runner.finished  # backfill() exits 1: run it again


# ------------------------------------------------------------------ a rewind inside consume()
def test_a_rewind_inside_consume_drops_the_record_poll_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    """poll() returned in[0]@2, then consume() served a revoke of in[1] whose checkpoint failed: the abort
    rewound in[0] to its commit (2), and the record poll() returned was tracked under the new epoch and
    processed beside its re-read: two results for one offset."""
    h = Harness(monkeypatch, make_config(delivery=EOS)).start()
    h.c.assign(("in", 0), ("in", 1))
    h.send(2, partition=0)
    h.process()
    h.commit()
    assert h.committed("in", 0) == 2
    h.send(3, partition=0)  # in[0]@2..4
    armed = h.c.consume_calls

    def revoke_in_consume() -> None:
        nonlocal armed
        if h.c.consume_calls == armed + 1:
            armed = -10
            h.p.fail_txn("commit", abortable())
            h.c.revoke(("in", 1))

    h.c.hooks.append(revoke_in_consume)
    h.iterate()
    assert armed == -10 and h.runner.mode.txn is not None and h.runner.mode.txn.aborts == 1
    for _ in range(4):
        h.process()
    h.commit()
    assert sources(h) == [(0, 0), (0, 1), (0, 2), (0, 3), (0, 4)]
    assert h.committed("in", 0) == 5


def test_a_record_read_again_while_tracked_is_not_processed_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch, make_config(delivery=EOS)).start()
    h.c.assign(("in", 0))
    h.send(2)
    h.iterate()
    h.c.positions[IN0] = 0  # the same records come again while they are tracked
    for _ in range(3):
        h.process()
    h.commit()
    assert Counter(sources(h)) == {(0, 0): 1, (0, 1): 1} and h.committed() == 2


# ------------------------------------------------------------------ rewind of a partition without a commit
def test_a_rewind_without_a_commit_goes_back_to_the_first_record_read(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With auto.offset.reset=latest, one abort before the first commit sought to OFFSET_BEGINNING: the whole
    retained history was processed."""
    h = Harness(monkeypatch, make_config(delivery=EOS,
                                         kafka={"consumer": {"auto.offset.reset": "latest"}})).start()
    h.send(100)  # history from before the worker ever ran
    h.c.assign(("in", 0), ("in", 1))
    h.c.positions[IN0] = h.c.high_watermark(IN0)  # what auto.offset.reset=latest does without a commit
    h.send(2)  # 100, 101
    h.process()
    h.p.fail_txn("commit", abortable())
    h.commit()
    assert h.c.seek_calls == [(IN0, 100)]  # in[1]: nothing read, no commit: no seek
    for _ in range(3):
        h.process()
    h.commit()
    assert sources(h) == [(0, 100), (0, 101)] and h.committed() == 102


# ------------------------------------------------------------------ librdkafka's abortable state
def test_produce_refused_in_the_abortable_state_aborts_and_rewinds(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a message of the transaction timed out, produce() raises _STATE before the failure report is
    served: that ended the worker (exit 1, "cannot produce to 'out'") instead of aborting."""
    h = Harness(monkeypatch, make_config(delivery=EOS)).start()
    h.c.assign(("in", 0))
    h.send(2)
    h.iterate()
    h.device.run_all()
    h.p.hold = True
    h.iterate()  # results of 0, 1 produced, not acknowledged
    h.send(2)
    h.iterate()
    h.device.run_all()  # 2, 3 finished: their results wait in the completion queue
    h.p.abortable = True  # librdkafka's message timer: 0, 1 timed out, reports not served yet
    h.p.hold = False
    h.p.fail_next(2)
    h.iterate()  # produces the results of 2, 3 before the failure reports are served
    assert h.runner.fatal is None and h.runner.mode.txn is not None and h.runner.mode.txn.aborts == 1
    for _ in range(4):
        h.process()
    h.commit()
    assert sources(h) == [(0, 0), (0, 1), (0, 2), (0, 3)] and h.committed() == 4
    assert h.runner.fatal is None


def test_a_failure_served_by_the_checkpoint_flush_aborts_once(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch, make_config(delivery=EOS)).start()
    h.c.assign(("in", 0))
    h.send(2)
    h.p.hold = True
    h.process()
    h.p.fail_next(1)

    def release() -> None:
        h.p.hold = False

    h.p.hooks.append(release)  # the checkpoint's own flush serves the failure
    h.commit()
    h.iterate()
    assert h.runner.mode.txn is not None and h.runner.mode.txn.aborts == 1
    assert h.runner.mode.abort_pending is None and h.runner.fatal is None
    for _ in range(3):
        h.process()
    h.commit()
    assert sources(h) == [(0, 0), (0, 1)]


# ------------------------------------------------------------------ commit_transaction timeouts
def test_a_commit_that_times_out_is_called_again(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch, make_config(delivery=EOS)).start()
    h.c.assign(("in", 0))
    h.send(3)
    h.process()
    h.p.fail_txn("commit", timed_out())
    h.commit()
    assert [c[0] for c in h.p.txn_calls][-3:] == ["commit", "commit", "begin"]
    assert h.runner.mode.txn is not None and h.runner.mode.txn.aborts == 0
    assert sources(h) == [(0, 0), (0, 1), (0, 2)] and h.committed() == 3 and h.runner.fatal is None


def test_a_commit_that_keeps_timing_out_stops_the_worker_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    """abort_transaction and begin_transaction are refused (_CONFLICT) while the commit goes on: the abort
    only logged, and the begin's KafkaException escaped the loop turn (a traceback crash)."""
    h = Harness(monkeypatch, make_config(delivery=EOS)).start()
    h.c.assign(("in", 0))
    h.send(3)
    h.process()
    for _ in range(3):
        h.p.fail_txn("commit", timed_out())
    h.runner.mode.last_commit = -1e9  # the periodic checkpoint
    h.iterate()
    assert "could not be aborted" in (h.runner.fatal or "")
    assert "begin" not in [c[0] for c in h.p.txn_calls[2:]]  # only the first transaction's
    assert h.p.results() == []


def test_a_begin_that_fails_stops_the_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch, make_config(delivery=EOS)).start()
    h.c.assign(("in", 0))
    h.send(1)
    h.process()
    h.p.fail_txn("begin", KafkaException(KafkaError(KafkaError._STATE, "Operation not valid in state X")))
    h.runner.mode.last_commit = -1e9
    h.iterate()
    assert "begin_transaction failed" in (h.runner.fatal or "")




def test_past_the_shutdown_deadline_a_commit_that_times_out_is_not_called_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the worker stops, each transactional call waits at most what is left of shutdown_timeout_s, and a
    timed-out commit is not called again past it: 3 calls of 30 s each outlived the pod's grace period."""
    h = Harness(monkeypatch, make_config(delivery=EOS)).start()
    h.c.assign(("in", 0))
    h.send(3)
    h.process()
    timeouts: list[float | None] = []
    real = h.p.commit_transaction

    def commit(timeout: float | None = None) -> None:
        timeouts.append(timeout)
        h.clock.advance(timeout or 0.0)  # it waited that long before timing out
        real(timeout)

    monkeypatch.setattr(h.p, "commit_transaction", commit)
    for _ in range(3):
        h.p.fail_txn("commit", timed_out())
    assert h.runner.mode.txn is not None
    h.runner.mode.stopping(Deadline(4.0, h.clock))  # what the shutdown drain sets
    h.commit()
    assert timeouts == [4.0]  # not 30, and not called again once past the deadline
    # exit 1: the next process starts from the commits
    assert "could not be aborted" in (h.runner.fatal or "")
