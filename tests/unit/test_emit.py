"""Emitter: outcomes -> result and dead-letter records, with per-record delivery tracking (a record is done
only when everything it owes is delivered), retries of failed deliveries, and stale records."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from confluent_kafka import KafkaError

from schemas import DeadLetter, Result
from tests.unit.fakes_kafka import FakeProducer, FakeTime, Harness, make_config, request
from worker.core.records import Outcome, Record, TopicPartition
from worker.emit import Emitter

TP = TopicPartition("in", 3)


class Calls:
    def __init__(self) -> None:
        self.done: list[int] = []
        self.failed: list[tuple[int, str]] = []


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeTime:
    import worker.emit

    c = FakeTime()
    monkeypatch.setattr(worker.emit, "time", c)
    return c


def emitter(producer: FakeProducer, calls: Calls, fmt: str = "json", stale: set[int] | None = None,
            max_retries: int = 2) -> Emitter:
    return Emitter(producer, "out", "dlq", "m", "v1", fmt,
                   on_done=lambda r: calls.done.append(r.offset),
                   on_failed=lambda r, e: calls.failed.append((r.offset, e)),
                   max_retries=max_retries, is_stale=lambda r: r.offset in (stale or set()))


def rec(offset: int = 0, id: str | None = "r", **kw: Any) -> Record:
    kw.setdefault("received_at", 10.0)
    return Record(tp=TP, offset=offset, value=b'{"raw": 1}', key=b"k", id=id, lane="hi", **kw)


def test_result_record(clock: FakeTime) -> None:
    p, calls = FakeProducer(), Calls()
    r = rec(5, meta={"t": 1}, produced_at_ms=1_000)
    emitter(p, calls).emit(Outcome(r, "ok", output=[1, 2], batch_size=4, timings={"queue": 0.002, "infer": 0.01}),
                           now=10.5, now_wall_ms=1_250.0)
    [m] = p.produced
    assert (m.topic, m.key, m.headers) == ("out", b"k", None)
    res = msgspec.json.decode(m.value or b"", type=Result)
    assert (res.id, res.status, res.outputs, res.model, res.model_version, res.lane, res.batch_size) == (
        "r", "ok", [1, 2], "m", "v1", "hi", 4)
    assert (res.source.topic, res.source.partition, res.source.offset, res.meta) == ("in", 3, 5, {"t": 1})
    assert (res.timings.queue_ms, res.timings.inference_ms, res.timings.total_ms, res.timings.e2e_ms) == (
        2.0, 10.0, 500.0, 250.0)
    assert calls.done == []  # produced is not delivered
    p.poll(0)
    assert calls.done == [5]


def test_msgpack_format(clock: FakeTime) -> None:
    p, calls = FakeProducer(), Calls()
    emitter(p, calls, fmt="msgpack").emit(Outcome(rec(), "ok", output={"a": 1}), 10.0, 0.0)
    assert msgspec.msgpack.decode(p.produced[0].value or b"", type=Result).outputs == {"a": 1}


def test_error_with_id_owes_a_result_and_a_dead_letter(clock: FakeTime) -> None:
    p, calls = FakeProducer(), Calls()
    r = rec(7, headers=[("trace", b"x"), ("x-error", b"stale"), ("x-source-offset", b"99"), ("x-attempts", b"9")],
            attempts=2)
    emitter(p, calls).emit(Outcome(r, "error", error="boom", dlq_stage="inference"), 10.0, 0.0)
    res, dl = p.produced
    assert res.topic == "out" and res.json()["status"] == "error" and res.json()["error"] == "boom"
    assert (dl.topic, dl.value, dl.key) == ("dlq", b'{"raw": 1}', b"k")
    assert dl.header("trace") == "x" and dl.header("x-source-offset") == "7" and dl.header("x-attempts") == "2"
    assert DeadLetter.from_headers(dl.headers) == DeadLetter(error="boom", error_stage="inference", source_topic="in",
                                                             source_partition=3, source_offset=7, attempts=2)
    p.deliver(lambda m: m.topic == "out")
    assert calls.done == []  # the dead letter is still owed
    p.poll(0)
    assert calls.done == [7]


def test_without_an_id_only_the_dead_letter(clock: FakeTime) -> None:
    p, calls = FakeProducer(), Calls()
    emitter(p, calls).emit(Outcome(rec(id=None), "error", error="x" * 5000, dlq_stage="decode"), 10.0, 0.0)
    [dl] = p.produced
    assert dl.topic == "dlq" and len(dl.header("x-error") or "") == 4000  # the reason is capped


def test_nothing_owed_is_done_at_once(clock: FakeTime) -> None:
    p, calls = FakeProducer(), Calls()
    emitter(p, calls).emit(Outcome(rec(id=None), "ok"), 10.0, 0.0)
    assert p.produced == [] and calls.done == [0]


def test_a_failed_round_resends_everything_and_ignores_its_other_reports(clock: FakeTime) -> None:
    p, calls = FakeProducer(), Calls()
    em = emitter(p, calls)
    em.emit(Outcome(rec(1), "error", error="e", dlq_stage="inference"), 10.0, 0.0)
    p.fail_next(1, topic="out")
    p.poll(0)  # result failed, dead letter delivered in the same round: ignored
    assert calls.done == [] and len(em.retry_queue) == 1
    clock.advance(1.0)  # past the backoff
    em.retry_failed()
    assert [m.topic for m in p.produced] == ["out", "dlq", "out", "dlq"]
    p.poll(0)
    assert calls.done == [1] and calls.failed == []


def test_gives_up_after_max_retries(clock: FakeTime) -> None:
    p, calls = FakeProducer(), Calls()
    em = emitter(p, calls, max_retries=2)
    em.emit(Outcome(rec(4), "ok", output=1), 10.0, 0.0)
    p.fail_next(None, topic="out")
    for _ in range(10):
        p.poll(0)
        em.retry_failed()
        clock.advance(1.0)
    assert len(p.produced) == 3  # first try + 2 retries
    assert calls.done == [] and [o for o, _ in calls.failed] == [4]
    assert "timed out" in calls.failed[0][1]


def test_stale_records_are_not_retried(clock: FakeTime) -> None:
    p, calls = FakeProducer(), Calls()
    em = emitter(p, calls, stale={2})
    em.emit(Outcome(rec(2), "ok", output=1), 10.0, 0.0)
    p.fail_next(1)
    p.poll(0)
    em.retry_failed()
    assert len(p.produced) == 1 and em.retry_queue == [] and calls.failed == []


def test_a_full_local_queue_serves_reports_then_produces(clock: FakeTime) -> None:
    p, calls = FakeProducer(queue_limit=2), Calls()
    em = emitter(p, calls)
    for i in range(5):
        em.emit(Outcome(rec(i), "ok", output=i), 10.0, 0.0)
    p.flush()
    assert len(p.delivered) == 5 and sorted(calls.done) == [0, 1, 2, 3, 4]


def test_the_batch_hot_path_writes_what_emit_writes_and_declines_what_it_cannot_send(clock: FakeTime) -> None:
    """emit_ok_many (one ok result per record of a batch) produces byte for byte what emit() produces for the
    same outcome, and hands back (sends nothing for) the records the general path must handle."""
    recs = [rec(i, meta={"i": i} if i else None, produced_at_ms=1_000 + i) for i in range(4)]
    outs: list[Any] = [[1, 2], Opaque(), {"big": "x" * 2000}, "last"]
    p, calls = FakeProducer(max_message_bytes=1_000), Calls()
    em = emitter(p, calls)
    em.max_message_bytes = 1_000
    declined = em.emit_ok_many(recs, outs, 4, closed_at=10.002, infer_s=0.01, now=10.5, now_wall_ms=1_250.0)
    assert declined == [1, 2]  # not encodable; over message.max.bytes
    ref, ref_calls = FakeProducer(), Calls()
    for i in (0, 3):
        emitter(ref, ref_calls).emit(Outcome(recs[i], "ok", output=outs[i], batch_size=4,
                                             timings={"queue": 10.002 - 10.0, "infer": 0.01}), 10.5, 1_250.0)
    assert [(m.topic, m.key, m.value) for m in p.produced] == [(m.topic, m.key, m.value) for m in ref.produced]
    assert em.produced == 2
    p.flush()
    assert sorted(calls.done) == [0, 3]


def test_the_batch_hot_path_waits_for_room_in_a_full_local_queue(clock: FakeTime) -> None:
    p, calls = FakeProducer(queue_limit=2), Calls()
    em = emitter(p, calls)
    assert em.emit_ok_many([rec(i) for i in range(5)], list(range(5)), 5, 10.0, 0.0, 10.0, 0.0) == []
    p.flush()
    assert em.produced == 5 and len(p.delivered) == 5 and sorted(calls.done) == [0, 1, 2, 3, 4]


# -------------------------------------------------------------------- what the broker or the encoder rejects
class Opaque:
    """A model output msgspec cannot encode (a numpy scalar, a tensor, a custom object...)."""


def test_an_unencodable_output_becomes_an_output_error_and_does_not_block(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.unit.fakes_kafka import FakeModel

    model = FakeModel(output=lambda x: Opaque() if x == 1 else {"echo": x})
    h = Harness(monkeypatch, model=model).start()
    h.c.assign(("in", 0))
    h.send(3)
    h.process()
    h.commit()
    assert h.committed() == 3
    results = {r["source"]["offset"]: r for r in h.p.results()}
    assert results[1]["status"] == "error" and results[0]["status"] == results[2]["status"] == "ok"
    [dead] = h.p.dead_letters()
    assert dead.header("x-error-stage") == "output" and dead.header("x-source-offset") == "1"


def test_records_too_large_for_the_producer_do_not_block_the_partition(monkeypatch: pytest.MonkeyPatch) -> None:
    """The input topic accepts bigger records than the producer may write (librdkafka's message.max.bytes
    defaults to 1,000,000 < delivery.max_input_bytes' 1 MiB): an oversize input's dead letter, or a result
    bigger than the limit, must not stop the worker."""
    cfg = make_config(delivery={"max_input_bytes": 1000},
                      kafka={"producer": {"message.max.bytes": 600}})
    h = Harness(monkeypatch, cfg).start()
    h.p.max_message_bytes = 600
    h.c.assign(("in", 0))
    h.c.append("in", 0, request("small", 1))
    h.c.append("in", 0, request("huge-input", "x" * 2000))  # rejected by size: its DLQ copy is too big
    h.c.append("in", 0, request("huge-output", "y" * 700))  # admitted; its result is too big
    h.c.append("in", 0, request("after", 2))
    h.process()
    h.commit()
    assert h.committed() == 4
    results = {r["id"]: r for r in h.p.results()}
    assert results["small"]["status"] == results["after"]["status"] == "ok"
    assert results["huge-output"]["status"] == "error"
    stages = {p.header("x-source-offset"): p.header("x-error-stage") for p in h.p.dead_letters()}
    assert stages == {"1": "size", "2": "output"}


def test_delivery_error_types_are_reported(clock: FakeTime) -> None:
    p, calls = FakeProducer(), Calls()
    em = emitter(p, calls, max_retries=0)
    em.emit(Outcome(rec(9), "ok", output=1), 10.0, 0.0)
    p.fail_next(1, err=KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "Broker: Message size too large"))
    p.poll(0)
    assert calls.failed and "size too large" in calls.failed[0][1]
