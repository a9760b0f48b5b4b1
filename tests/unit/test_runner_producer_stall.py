"""A producer that keeps results undelivered (librdkafka#5430: a partition left without a leader after a
broker pause) is replaced by the runner's emitter: what it held is sent again on a new producer, the records
commit once that delivers, the replacement is counted, and the shutdown flushes the producers the emitter uses
now."""

from __future__ import annotations

import pytest

from tests.unit.fakes_kafka import Harness, Produced, make_config
from worker.observability.metrics import PrometheusMetrics


def src(m: Produced) -> int:
    return int(m.json()["source"]["offset"])


def test_a_stalled_producer_is_replaced_and_its_records_commit_once_sent_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    metrics = PrometheusMetrics()
    h = Harness(monkeypatch, make_config(delivery={"producer_stall_s": 20}), spare=True,
                metrics=metrics).start()
    assert h.spare is not None
    h.c.assign(("in", 0))
    h.p.hold = True  # the first producer never delivers what it gets
    h.send(3)
    h.process()  # 0, 1, 2 go out on it
    assert [src(m) for m in h.p.produced] == [0, 1, 2] and h.replacements == []
    h.clock.advance(19.9)
    h.iterate()
    h.commit()
    assert h.replacements == [] and h.committed() is None
    h.clock.advance(0.1)
    h.iterate()  # 20 s: purged, a new producer takes its slot, the records wait out their retry backoff
    assert h.p.purge_calls == 1 and len(h.replacements) == 1
    assert h.runner.emitter.slots[0].producer is h.replacements[0]
    assert metrics.producer_replacements_total._value.get() == 1
    h.clock.advance(1.0)
    h.iterate(3)  # re-sent on the current producer, delivered, confirmed
    h.commit()
    assert h.committed() == 3
    resent = [src(m) for p in (h.spare, *h.replacements) for m in p.produced]
    assert sorted(resent) == [0, 1, 2]
    flushes = h.replacements[0].flush_calls
    h.runner.close()
    assert h.replacements[0].flush_calls > flushes  # the shutdown flushes the producer in use now
    assert h.p.flush_calls == 0  # not the purged one: it holds nothing and is never called again


def test_exactly_once_keeps_its_transactional_producer(monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch, make_config(delivery={"mode": "exactly_once"})).start()
    assert h.runner.emitter.new_producer is None
