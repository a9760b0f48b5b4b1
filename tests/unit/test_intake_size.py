"""A record that costs more than the model's own limit (the handler's ``max_size``) is refused to the DLQ
(stage "size") with the reason, before it reaches a lane; one at the limit is admitted."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.fakes_kafka import FakeModel, Harness, make_config, request
from worker.core.records import Record, TopicPartition
from worker.pipeline.intake import Intake


class Sized(FakeModel):
    """Inputs are strings; a record's size is its length, at most ``max_size``."""

    max_size = 5

    def size_of(self, item: Any) -> int:
        return len(item)


def _record(text: str) -> Record:
    return Record(tp=TopicPartition("in", 0), offset=3, value=request("r1", text), received_at=1.0)


def test_over_the_models_max_size_is_refused_with_the_reason() -> None:
    it = Intake(make_config(), Sized())
    rec = _record("abcdef")
    o = it.admit(rec, 1.0)
    assert o is not None and o.dlq_stage == "size" and o.status == "error" and rec.id == "r1"
    assert o.error == "record size 6 (the model's size_of) is over the model's max_size=5"


def test_at_the_models_max_size_is_admitted() -> None:
    rec = _record("abcde")
    assert Intake(make_config(), Sized()).admit(rec, 1.0) is None and rec.size == 5


def test_without_max_size_any_size_is_admitted() -> None:
    class Unbounded(Sized):
        max_size = None  # type: ignore[assignment]

    rec = _record("x" * 100)
    assert Intake(make_config(), Unbounded()).admit(rec, 1.0) is None and rec.size == 100


def test_refused_record_reaches_the_dlq_and_never_blocks_the_partition(
        monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch, make_config(), model=Sized()).start()
    h.c.assign(("in", 0))
    for v in (request("long", "abcdefgh"), request("short", "abc")):
        h.c.append("in", 0, v)
    h.process()
    h.commit()
    assert h.committed() == 2  # the refused record is committed with the one behind it
    assert [x for batch in h.model.forward_calls for x in batch] == ["abc"]
    results = {r["id"]: r for r in h.p.results()}
    assert results["long"]["status"] == "error" and "max_size=5" in results["long"]["error"]
    assert results["short"]["status"] == "ok"
    (dead,) = h.p.dead_letters()
    assert dead.header("x-error-stage") == "size" and dead.header("x-source-offset") == "0"
