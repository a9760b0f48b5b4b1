"""A consumer out of its group longer than ``kafka.rejoin_timeout_ms`` is replaced
(worker/core/membership.py): a new consumer subscribes, the old one closes on a thread of its own and nothing
it serves while closing reaches the runner, and the new member goes on from the group's commits with nothing
lost."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError

from tests.unit.fakes_kafka import Harness, ktps, make_config
from worker.core.records import TopicPartition

IN0 = TopicPartition("in", 0)
TIMEOUT_S = 5.0


def harness(monkeypatch: pytest.MonkeyPatch, **sections: dict[str, Any]) -> Harness:
    kafka = {"rejoin_timeout_ms": int(TIMEOUT_S * 1000), **sections.pop("kafka", {})}
    return Harness(monkeypatch, make_config(kafka=kafka, **sections)).start()


def offsets_out(h: Harness) -> list[int]:
    return sorted(r["source"]["offset"] for r in h.p.results())


def join_closers(h: Harness) -> None:
    for t in h.runner.membership.closing_consumers:
        t.join(5)
        assert not t.is_alive()


def test_a_lost_consumer_that_does_not_rejoin_is_replaced_and_the_new_one_goes_on_from_the_commits(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.observability.metrics import PrometheusMetrics

    metrics = PrometheusMetrics()
    h = Harness(monkeypatch, make_config(kafka={"rejoin_timeout_ms": 5000}), metrics=metrics).start()
    old = h.c
    old.assign(("in", 0))
    h.send(3)
    h.process()
    h.commit()
    assert h.committed() == 3
    h.send(2)
    h.iterate()  # 3 and 4 consumed, queued
    old.lose()  # a session timeout: librdkafka should rejoin by itself, and here never does
    h.clock.advance(TIMEOUT_S - 0.5)
    h.iterate()
    assert h.consumers == [old]
    h.clock.advance(0.5)
    h.iterate()
    assert len(h.consumers) == 2
    new = h.c
    assert h.runner.consumer is new and new.topics == ["in"] and new.callbacks["on_assign"] is not None
    join_closers(h)
    assert old.closed and not new.closed
    assert metrics.rebalances_total.labels(kind="replace")._value.get() == 1
    new.assign(("in", 0))  # the new member joins
    h.process()
    h.commit()
    assert offsets_out(h) == [0, 1, 2, 3, 4]  # 3 and 4 were dropped with the lost partition, processed now
    assert h.committed() == 5


def test_no_first_assignment_after_subscribing_is_replaced_too(monkeypatch: pytest.MonkeyPatch) -> None:
    h = harness(monkeypatch)
    h.clock.advance(TIMEOUT_S)
    h.iterate()
    assert len(h.consumers) == 2
    join_closers(h)
    assert h.consumers[0].closed and h.runner.consumer is h.consumers[1]


def test_an_empty_assignment_is_membership_an_idle_replica_is_never_replaced(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    h = harness(monkeypatch)
    h.c.assign()  # more members than partitions: the group says so with an empty assignment
    for _ in range(5):
        h.clock.advance(TIMEOUT_S * 10)
        h.iterate()
    assert len(h.consumers) == 1


def test_a_revoke_is_not_a_loss(monkeypatch: pytest.MonkeyPatch) -> None:
    h = harness(monkeypatch)
    h.c.assign(("in", 0))
    h.c.revoke(("in", 0))  # a cooperative rebalance took the partition; the member stays in the group
    h.clock.advance(TIMEOUT_S * 10)
    h.iterate()
    assert len(h.consumers) == 1


def test_zero_never_replaces(monkeypatch: pytest.MonkeyPatch) -> None:
    h = harness(monkeypatch, kafka={"rejoin_timeout_ms": 0})
    h.c.assign(("in", 0))
    h.c.lose()
    h.clock.advance(1e6)
    h.iterate()
    assert len(h.consumers) == 1


def test_replacements_without_a_join_wait_twice_as_long_each_time(monkeypatch: pytest.MonkeyPatch) -> None:
    h = harness(monkeypatch)
    h.c.assign(("in", 0))
    h.c.lose()
    made_at = []
    for _ in range(int(TIMEOUT_S * 20)):
        h.clock.advance(1.0)
        n = len(h.consumers)
        h.iterate()
        if len(h.consumers) > n:
            made_at.append(h.clock.t)
    gaps = [round(b - a) for a, b in zip(made_at, made_at[1:], strict=False)]
    assert gaps[:2] == [TIMEOUT_S * 2, TIMEOUT_S * 4]
    h.c.assign(("in", 0))  # joined: the allowance is the configured one again
    h.c.lose()
    n = len(h.consumers)
    h.clock.advance(TIMEOUT_S)
    h.iterate()
    assert len(h.consumers) == n + 1
    join_closers(h)


def test_what_the_replaced_consumer_serves_while_closing_never_reaches_the_runner(
        monkeypatch: pytest.MonkeyPatch) -> None:
    h = harness(monkeypatch)
    old = h.c
    old.assign(("in", 0))
    h.send(2)
    h.process()
    h.commit()
    old.lose()
    h.clock.advance(TIMEOUT_S)
    h.iterate()
    join_closers(h)
    r = h.runner
    committed, broker_ok = dict(r.committed), r.loop.broker_ok
    # Late callbacks of the old consumer: an assignment, a commit report, a client error.
    old.callbacks["on_assign"](old, ktps([("in", 0)]))
    old.callbacks["on_lost"](old, ktps([("in", 0)]))
    old.config["on_commit"](None, ktps([("in", 0)]))
    old.config["error_cb"](KafkaError(KafkaError._ALL_BROKERS_DOWN, "old consumer"))
    assert r.assigned == set() and r.committed == committed and r.loop.broker_ok is broker_ok
    # The same callbacks of the new consumer do reach it.
    h.c.assign(("in", 0))
    assert r.assigned == {IN0}
    h.c.config["error_cb"](KafkaError(KafkaError._ALL_BROKERS_DOWN, "new consumer"))
    assert r.loop.broker_ok is False


def test_exactly_once_commits_through_the_new_consumer(monkeypatch: pytest.MonkeyPatch) -> None:
    h = harness(monkeypatch, delivery={"mode": "exactly_once", "transactional_id": "tid-1"})
    h.c.lose()
    h.clock.advance(TIMEOUT_S)
    h.iterate()
    assert h.runner.mode.txn is not None and h.runner.mode.txn.consumer is h.c and len(h.consumers) == 2
    h.c.assign(("in", 0))
    h.send(2)
    h.process()
    h.commit()
    assert h.committed() == 2 and offsets_out(h) == [0, 1]
    join_closers(h)


def test_callbacks_reach_a_runner_that_holds_a_wrapper_of_its_consumer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """librdkafka passes a rebalance callback the consumer itself, not the wrapper the runner may hold
    (tests/bench/profile_worker.py times every call through one): what is current is decided by the latter."""

    class Proxy:
        def __init__(self, inner: Any) -> None:
            self.inner = inner

        def __getattr__(self, name: str) -> Any:
            return getattr(self.inner, name)

    h = Harness(monkeypatch, make_config(kafka={"rejoin_timeout_ms": 5000}), wrap_consumer=Proxy).start()
    assert isinstance(h.runner.consumer, Proxy)
    h.c.assign(("in", 0))
    h.send(2)
    h.process()
    h.commit()
    assert h.runner.assigned == {IN0} and offsets_out(h) == [0, 1] and h.committed() == 2
    h.c.lose()
    assert h.runner.assigned == set()
    h.clock.advance(TIMEOUT_S)
    h.iterate()
    assert len(h.consumers) == 2 and isinstance(h.runner.consumer, Proxy) and h.runner.consumer.inner is h.c
    h.c.assign(("in", 0))
    assert h.runner.assigned == {IN0}
    join_closers(h)
