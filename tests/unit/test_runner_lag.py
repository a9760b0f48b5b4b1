"""Runner, the lag it reports and commits: ``kiw_consumer_lag`` and ``kiw_drain_seconds`` (the HPA's scaling
signal) read 0 on an idle replica, and input written by a transactional producer does not leave a lag of 1
per partition (the commit marker after the last record takes an offset no consume returns)."""

from __future__ import annotations

import pytest

from tests.unit.fakes_kafka import Harness, make_config
from worker.core.records import TopicPartition
from worker.observability.metrics import PrometheusMetrics

ONE_BY_ONE = {"lanes": [{"name": "default", "max_batch_size": 1}]}


def sample(m: PrometheusMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


def lag_harness(monkeypatch: pytest.MonkeyPatch, **cfg: object) -> tuple[Harness, PrometheusMetrics]:
    m = PrometheusMetrics()
    h = Harness(monkeypatch, make_config(metrics={"enabled": False, "lag_interval_s": 5}, **cfg),
                metrics=m).start()
    h.c.assign(("in", 0))
    return h, m


def report(h: Harness, seconds: float) -> None:
    h.clock.advance(seconds)
    h.runner.lag.report(h.clock.t)


def test_the_periodic_commit_steps_over_transaction_markers(monkeypatch: pytest.MonkeyPatch) -> None:
    h, m = lag_harness(monkeypatch)
    h.send(3)
    h.c.append_marker("in", 0)  # offset 3
    h.send(2)
    h.c.append_marker("in", 0)  # offset 6: the high watermark is 7
    h.process()
    assert h.result_ids() == ["in-0-0", "in-0-1", "in-0-2", "in-0-4", "in-0-5"]
    h.commit()  # a synchronous commit (revoke, shutdown) keeps to the tracker's offsets
    assert h.committed() == 6
    h.runner.mode.commit(sync=False)  # the loop's periodic commit: the consumer's position, past the marker
    assert h.committed() == 7
    h.iterate()  # serves the commit report
    report(h, 5)
    assert sample(m, "kiw_consumer_lag", topic="in", partition="0") == 0
    assert sample(m, "kiw_drain_seconds") == 0


def test_no_step_over_while_a_record_of_the_partition_is_unfinished(monkeypatch: pytest.MonkeyPatch) -> None:
    h, _ = lag_harness(monkeypatch, batching=ONE_BY_ONE)
    h.send(3)
    h.c.append_marker("in", 0)  # offset 3
    h.send(1)  # offset 4, left on the device
    h.iterate()
    for _ in range(3):
        b = h.device.take()
        assert b is not None
        h.device.finish(b)
    h.iterate()
    assert h.result_ids() == ["in-0-0", "in-0-1", "in-0-2"]
    h.runner.mode.commit(sync=False)
    # up to the unfinished record (the marker before it is a gap), not the position 5
    assert h.committed() == 4
    h.device.run_all()
    h.iterate()
    h.runner.mode.commit(sync=False)
    assert h.committed() == 5


def test_drain_seconds_is_not_the_cap_for_a_burst_after_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """The cap (86400 s) sent an HPA to maxReplicas: it came for any lag reported while nothing had completed
    in the last 60 s, i.e. for the first report of every burst after a quiet minute."""
    h, m = lag_harness(monkeypatch)
    h.send(10)
    h.process()
    h.commit()
    for _ in range(30):  # 150 s idle
        report(h, 5)
    assert sample(m, "kiw_drain_seconds") == 0
    h.send(5)
    h.iterate()  # read; its batch not finished at the next report
    report(h, 5)
    drain = sample(m, "kiw_drain_seconds")
    assert drain is not None and 0 < drain < 60
    for _ in range(12):  # ... and still not after a whole minute: the replica is stuck, the cap is right
        report(h, 5)
    assert sample(m, "kiw_drain_seconds") == 86_400


def test_the_step_over_a_marker_survives_a_handover(monkeypatch: pytest.MonkeyPatch) -> None:
    """The revoke's synchronous commit keeps to the tracker's offset (3, on the marker); the next owner has
    tracked nothing of the partition and never stepped: a lag of 1 for good."""
    h, _m = lag_harness(monkeypatch)
    h.send(3)
    h.c.append_marker("in", 0)  # offset 3: the high watermark is 4
    h.process()
    h.c.revoke(("in", 0))
    assert h.committed() == 3
    h.c.assign(("in", 0))
    h.iterate()  # the fetch serves the marker: the position is 4
    h.runner.mode.commit(sync=False)
    h.iterate()
    assert h.committed() == 4


def test_a_group_whose_commit_sits_on_a_marker_steps_over_it(monkeypatch: pytest.MonkeyPatch) -> None:
    h, _m = lag_harness(monkeypatch)
    h.send(3)
    h.c.append_marker("in", 0)
    h.c.revoke(("in", 0))
    h.c.committed_offsets[TopicPartition("in", 0)] = 3  # committed by an earlier version: on the marker
    h.c.assign(("in", 0))
    # nothing served since the assign: the position is unknown, nothing to step
    h.runner.mode.commit(sync=False)
    assert h.c.commit_calls == []
    h.iterate()
    h.runner.mode.commit(sync=False)
    h.iterate()
    assert h.committed() == 4
    h.runner.mode.commit(sync=False)  # idle: not the same offset again every interval
    assert len(h.c.commit_calls) == 1


def test_exactly_once_checkpoints_step_over_markers(monkeypatch: pytest.MonkeyPatch) -> None:
    h, _m = lag_harness(monkeypatch, delivery={"mode": "exactly_once", "transactional_id": "t"})
    h.send(3)
    h.c.append_marker("in", 0)  # offset 3
    h.process()
    h.commit()  # a checkpoint of a revoke or a shutdown keeps to the tracker's offsets
    assert h.committed() == 3
    h.runner.mode.commit(sync=False)  # the loop's periodic checkpoint
    assert h.committed() == 4 and h.p.txn_offsets()[-1] == {TopicPartition("in", 0): 4}


def test_no_step_after_a_rewind_until_the_records_are_read_again(monkeypatch: pytest.MonkeyPatch) -> None:
    from confluent_kafka import KafkaError, KafkaException

    h, _m = lag_harness(monkeypatch, delivery={"mode": "exactly_once", "transactional_id": "t"})
    h.send(3)
    h.c.append_marker("in", 0)
    h.process()
    h.p.fail_txn("commit", KafkaException(KafkaError(KafkaError._INCONSISTENT, "x", txn_requires_abort=True)))
    h.runner.mode.commit(sync=False)  # aborts and rewinds to offset 0: the position is unknown again
    sent = len(h.p.txn_offsets())
    h.runner.mode.commit(sync=False)
    assert h.committed() is None and len(h.p.txn_offsets()) == sent  # not the position 4 before the re-read
    for _ in range(3):
        h.process()
    h.runner.mode.commit(sync=False)
    assert h.committed() == 4 and [r["id"] for r in h.p.results()] == ["in-0-0", "in-0-1", "in-0-2"]
