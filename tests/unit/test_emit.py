"""Emitter: outcomes -> result and dead-letter records, with per-record delivery tracking (a record is done
only when everything it owes is delivered), retries of failed deliveries, and stale records."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from confluent_kafka import KafkaError
from hypothesis import example, given, settings
from hypothesis import strategies as st

from schemas import DeadLetter, Result
from tests.support.props import examples
from tests.unit.fakes_kafka import FakeModel, FakeProducer, FakeTime, Harness, Produced, make_config, request
from worker.core.records import Outcome, Record, TopicPartition
from worker.output.emit import Emitter
from worker.output.settling import SWITCH_AFTER_S, Pending

TP = TopicPartition("in", 3)


class Calls:
    def __init__(self) -> None:
        self.done: list[int] = []
        self.failed: list[tuple[int, str]] = []


# The fake clock of the running test: ``emitter()`` hands it to the Emitter it builds (``clock=``).
_CLOCK: list[FakeTime] = []


@pytest.fixture
def clock() -> Iterator[FakeTime]:
    c = FakeTime()
    _CLOCK.append(c)
    yield c
    _CLOCK.remove(c)


def emitter(producer: FakeProducer, calls: Calls, fmt: str = "json", stale: set[int] | None = None,
            max_retries: int = 2, spare: FakeProducer | None = None) -> Emitter:
    return Emitter(producer, "out", "dlq", "m", "v1", fmt,
                   on_done=lambda r: calls.done.append(r.offset),
                   on_failed=lambda r, e: calls.failed.append((r.offset, e)),
                   max_retries=max_retries, is_stale=lambda r: r.offset in (stale or set()),
                   spare_producer=spare, clock=_CLOCK[-1] if _CLOCK else FakeTime())


def rec(offset: int = 0, id: str | None = "r", **kw: Any) -> Record:
    kw.setdefault("received_at", 10.0)
    return Record(tp=TP, offset=offset, value=b'{"raw": 1}', key=b"k", id=id, lane="hi", **kw)


def test_result_record(clock: FakeTime) -> None:
    p, calls = FakeProducer(), Calls()
    r = rec(5, meta={"t": 1}, produced_at_ms=1_000)
    em = emitter(p, calls)
    em.emit(Outcome(r, "ok", output=[1, 2], batch_size=4, timings={"queue": 0.002, "infer": 0.01}),
            now=10.5, now_wall_ms=1_250.0)
    [m] = p.produced
    assert (m.topic, m.key, m.headers) == ("out", b"k", None)
    res = msgspec.json.decode(m.value or b"", type=Result)
    assert (res.id, res.status, res.outputs, res.model, res.model_version, res.lane, res.batch_size) == (
        "r", "ok", [1, 2], "m", "v1", "hi", 4)
    assert (res.source.topic, res.source.partition, res.source.offset, res.meta) == ("in", 3, 5, {"t": 1})
    assert (res.timings.queue_ms, res.timings.inference_ms, res.timings.total_ms, res.timings.e2e_ms) == (
        2.0, 10.0, 500.0, 250.0)
    em.settle(10.5)
    assert calls.done == []  # produced is not delivered
    em.poll()
    em.settle(10.5)
    assert calls.done == [5]


def test_msgpack_format(clock: FakeTime) -> None:
    p, calls = FakeProducer(), Calls()
    emitter(p, calls, fmt="msgpack").emit(Outcome(rec(), "ok", output={"a": 1}), 10.0, 0.0)
    assert msgspec.msgpack.decode(p.produced[0].value or b"", type=Result).outputs == {"a": 1}


def test_error_with_id_owes_a_result_and_a_dead_letter(clock: FakeTime) -> None:
    p, calls = FakeProducer(), Calls()
    r = rec(7, headers=[("trace", b"x"), ("x-error", b"stale"), ("x-source-offset", b"99"),
                        ("x-attempts", b"9")],
            attempts=2)
    em = emitter(p, calls)
    em.emit(Outcome(r, "error", error="boom", dlq_stage="inference"), 10.0, 0.0)
    res, dl = p.produced
    assert res.topic == "out" and res.json()["status"] == "error" and res.json()["error"] == "boom"
    assert (dl.topic, dl.value, dl.key) == ("dlq", b'{"raw": 1}', b"k")
    assert (
        dl.header("trace") == "x" and dl.header("x-source-offset") == "7" and dl.header("x-attempts") == "2"
    )
    assert DeadLetter.from_headers(dl.headers) == DeadLetter(error="boom", error_stage="inference",
                                                             source_topic="in",
                                                             source_partition=3, source_offset=7, attempts=2)
    p.deliver(lambda m: m.topic == "out")
    em.settle(10.0)
    assert calls.done == []  # the dead letter is still owed
    em.poll()
    em.settle(10.0)
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
    em.poll()  # result failed, dead letter delivered in the same round: ignored
    em.settle(10.0)  # the producer has drained, but the round failed: not confirmed
    assert calls.done == [] and len(em.retry_queue) == 1 and len(p) == 0
    clock.advance(1.0)  # past the backoff
    em.retry_failed()
    assert [m.topic for m in p.produced] == ["out", "dlq", "out", "dlq"]
    em.poll()
    em.settle(11.0)
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
    assert em.flush(1.0) == 0
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
    assert [(m.topic, m.key, m.value) for m in p.produced] == [
        (m.topic, m.key, m.value) for m in ref.produced
    ]
    assert em.produced == 2
    em.flush(1.0)
    assert sorted(calls.done) == [0, 3]


def test_the_batch_hot_path_waits_for_room_in_a_full_local_queue(clock: FakeTime) -> None:
    p, calls = FakeProducer(queue_limit=2), Calls()
    em = emitter(p, calls)
    assert em.emit_ok_many([rec(i) for i in range(5)], list(range(5)), 5, 10.0, 0.0, 10.0, 0.0) == []
    em.flush(1.0)
    assert em.produced == 5 and len(p.delivered) == 5 and sorted(calls.done) == [0, 1, 2, 3, 4]


def test_a_failed_message_of_a_batch_is_retried_alone_and_the_others_are_confirmed(clock: FakeTime) -> None:
    """A batch's results share one delivery callback: a failure report finds its record by the message's
    value; that record alone is retried, the others are done when their producer drains."""
    p, calls = FakeProducer(), Calls()
    em = emitter(p, calls)
    p.fail_if = lambda m: (KafkaError(KafkaError._MSG_TIMED_OUT, "timed out")
                           if m.json()["source"]["offset"] == 2 and len(p.produced) <= 4 else None)
    ok(em, [0, 1, 2, 3], 10.0)
    em.poll()
    em.settle(10.0)
    assert sorted(calls.done) == [0, 1, 3] and [q.record.offset for q in em.retry_queue] == [2]
    clock.advance(1.0)
    em.retry_failed()
    em.poll()
    em.settle(clock.t)
    assert sorted(calls.done) == [0, 1, 2, 3] and calls.failed == [] and em.unconfirmed == 0
    assert [src(m) for m in p.produced] == [0, 1, 2, 3, 2]


# -------------------------------------------------------------------- what the broker or the encoder rejects
class Opaque:
    """A model output msgspec cannot encode (a numpy scalar, a tensor, a custom object...)."""


def test_an_unencodable_output_becomes_an_output_error_and_does_not_block(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
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


def test_records_too_large_for_the_producer_do_not_block_the_partition(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
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


# -------------------------------------------------------------------- settling: done when its producer drains
def ok(em: Emitter, offsets: list[int], now: float) -> None:
    assert em.emit_ok_many([rec(i) for i in offsets], offsets, len(offsets), now, 0.0, now, 0.0) == []


def test_success_reports_are_not_needed_and_change_nothing(clock: FakeTime) -> None:
    """With delivery.report.only.error (the worker's default) a success calls nothing; without it, a success
    report does not confirm the record either: only its producer draining does."""
    for only_error in (True, False):
        p, calls = FakeProducer(config={"delivery.report.only.error": only_error}), Calls()
        em = emitter(p, calls)
        ok(em, [0, 1], 10.0)
        p.deliver(lambda m: m.json()["source"]["offset"] == 0)  # reported (or not); 1 still outstanding
        em.settle(10.0)
        assert calls.done == []
        em.poll()
        em.settle(10.0)
        assert calls.done == [0, 1]


def test_sending_moves_to_the_spare_producer_while_the_first_one_drains(clock: FakeTime) -> None:
    a, b, calls = FakeProducer(), FakeProducer(), Calls()
    em = emitter(a, calls, spare=b)
    a.hold = b.hold = True  # nothing acknowledged until released
    ok(em, [0, 1], 10.0)
    em.settle(10.0 + SWITCH_AFTER_S / 2)  # too soon to move: batches of a linger's worth per producer
    ok(em, [2], 10.003)
    assert (len(a.produced), len(b.produced)) == (3, 0)
    em.settle(10.0 + SWITCH_AFTER_S)
    ok(em, [3], 10.006)
    assert (len(a.produced), len(b.produced)) == (3, 1)
    a.hold = False
    em.poll()
    em.settle(10.007)
    assert calls.done == [0, 1, 2] and em.unconfirmed == 1  # a drained; b has not
    em.settle(10.02)  # b has held its record long enough and a is confirmed: back to a
    ok(em, [4], 10.02)
    assert (len(a.produced), len(b.produced)) == (4, 1)
    a.hold = True
    em.settle(10.03)  # both hold unconfirmed records: sending stays where it is
    ok(em, [5], 10.03)
    assert (len(a.produced), len(b.produced)) == (5, 1)
    b.hold = False
    em.poll()
    em.settle(10.031)
    assert calls.done == [0, 1, 2, 3]
    assert em.flush(0.0) == 2 and calls.done == [0, 1, 2, 3]  # a still holds 4 and 5
    a.hold = False
    assert em.flush(1.0) == 0 and calls.done == [0, 1, 2, 3, 4, 5] and em.unconfirmed == 0


def test_a_failure_on_the_spare_is_retried_and_never_confirmed_by_draining(clock: FakeTime) -> None:
    a, b, calls = FakeProducer(), FakeProducer(), Calls()
    em = emitter(a, calls, spare=b)
    ok(em, [0], 10.0)
    em.settle(10.01)  # a still has 0 outstanding: sending moves to b
    ok(em, [1, 2], 10.01)
    assert [len(a.produced), len(b.produced)] == [1, 2]
    b.fail_next(1)
    em.poll()  # 0 delivered on a; 1 failed and 2 delivered on b
    em.settle(10.011)
    assert sorted(calls.done) == [0, 2] and len(em.retry_queue) == 1 and len(b) == 0
    clock.advance(1.0)
    em.retry_failed()  # re-sent on the current producer
    em.poll()
    em.settle(10.02)
    assert sorted(calls.done) == [0, 1, 2] and calls.failed == []


def test_a_retry_that_fails_again_is_not_confirmed(clock: FakeTime) -> None:
    p, calls = FakeProducer(), Calls()
    em = emitter(p, calls, max_retries=3)
    ok(em, [0], 10.0)
    p.fail_next(2)  # the first send and its retry
    for _ in range(2):
        em.poll()
        em.settle(clock.t)
        assert calls.done == [] and len(p) == 0
        clock.advance(1.0)
        em.retry_failed()
    em.poll()
    em.settle(clock.t)
    assert calls.done == [0] and [m.error is None for m in p.produced] == [False, False, True]


@settings(max_examples=examples(150), deadline=None)
@example(ops=[("ok", 0, 1), ("fail", 1, 1), ("hold", 0, 1), ("retry", 0, 1), ("settle", 0, 1), ("ok", 0, 1),
              ("ok", 0, 1), ("deliver", 0, 1), ("deliver", 1, 1), ("hold", 1, 1), ("retry", 0, 1),
              ("settle", 0, 1)])
@example(ops=[("ok", 0, 1), ("fail", 0, 1), ("deliver", 0, 1), ("fail", 0, 1), ("retry", 0, 2),
              ("settle", 0, 1)])
@given(st.lists(st.tuples(st.sampled_from(["ok", "dlq", "deliver", "fail", "hold", "release",
                                           "settle", "retry"]),
                          st.integers(0, 3), st.integers(1, 5)), max_size=60))
def test_a_record_is_done_only_when_every_message_of_its_last_round_is_delivered(
        ops: list[tuple[str, int, int]]) -> None:
    """Random sends (one or two messages per record), acknowledgements in any order, failures and settling on
    two producers: no record is done before each message of its last send round is delivered, none twice, and
    once the broker takes everything, every record ends done or failed.

    A record's last round is its last messages in the order they were sent across both producers: a retry
    goes on whichever producer is current, so its round can sit on the first producer while the failed round
    sits on the second (the first example: record 1 fails on P1 and is retried, and delivered, on P0). The
    second: a retried round that fails again leaves its entry on the producer it went on, which then settles
    with nothing outstanding; that entry confirms nothing."""
    clock = FakeTime()
    _CLOCK.append(clock)
    try:
        prods = [FakeProducer(config={"delivery.report.only.error": True}) for _ in range(2)]
        journal: list[Produced] = []  # every message of both producers, in the order it was sent
        for prod in prods:
            def produce(*args: Any, _prod: FakeProducer = prod, _produce: Any = prod.produce,
                        **kw: Any) -> None:
                _produce(*args, **kw)
                journal.append(_prod.produced[-1])
            prod.produce = produce  # type: ignore[method-assign]
        calls = Calls()
        em = emitter(prods[0], calls, spare=prods[1], max_retries=3)
        offset = 0

        def sent(off: int) -> list[Produced]:
            return [
                m
                for m in journal
                if (
                    int(m.header("x-source-offset") or -1)
                    if m.topic == "dlq"
                    else m.json()["source"]["offset"]
                )
                == off
            ]

        def check() -> None:
            assert len(calls.done) == len(set(calls.done))
            for off in calls.done:
                msgs = sent(off)
                last_round = msgs[-2:] if msgs[-1].topic == "dlq" else msgs[-1:]
                for m in last_round:
                    assert m.error is None and any(m is d for p in prods for d in p.delivered), (off, m)

        for op, which, n in ops:
            p = prods[which % 2]
            if op == "ok":
                ok(em, list(range(offset, offset + n)), clock.t)
                offset += n
            elif op == "dlq":
                em.emit(Outcome(rec(offset), "error", error="e", dlq_stage="inference"), clock.t, 0.0)
                offset += 1
            elif op == "deliver":
                chosen = iter([True] * n)
                p.deliver(lambda _m, c=chosen: next(c, False))  # the first n outstanding
            elif op == "fail":
                p.fail_next(1)
            elif op == "hold":
                p.hold = True
            elif op == "release":
                p.hold = False
            elif op == "settle":
                em.poll()
                em.settle(clock.t)
            else:
                clock.advance(0.03 * n)  # backoff: 50 ms after a first failure
                em.retry_failed()
            check()
        for p in prods:
            p.hold = False
            p._fail_rules.clear()
        for _ in range(10):
            clock.advance(1.0)
            em.retry_failed()
            em.flush(1.0)
            check()
        assert sorted(calls.done + [o for o, _ in calls.failed]) == list(range(offset))
    finally:
        _CLOCK.remove(clock)


# -------------------------------------------------------------------- message size, as librdkafka counts it
def _real_producer(limit: int) -> Any:
    """A real librdkafka producer (no broker: produce() only checks and enqueues, which is what is tested)."""
    from confluent_kafka import Producer

    return Producer({"bootstrap.servers": "127.0.0.1:1", "message.max.bytes": limit, "log_level": 0})


def test_the_size_check_agrees_with_librdkafka_at_the_boundary() -> None:
    from confluent_kafka import KafkaException

    limit = 100_000
    real = _real_producer(limit)

    def accepted(key: bytes | None, value: bytes, headers: list[tuple[str, bytes]] | None) -> bool:
        try:
            real.produce("t", value=value, key=key, headers=headers)
            return True
        except KafkaException:
            return False

    # Header lengths of 1-, 2- and 3-byte varints.
    for key, headers in [(None, None), (b"k" * 30, None), (b"k", [("x-error", b"e" * 200),
                                                                  ("x-source-topic", b"in")]),
                         (b"k", [("h" * 70, b"v" * 9_000)]), (b"", DeadLetter(
                             error="e" * 500, error_stage="validate", source_topic="in", source_partition=1,
                             source_offset=2, attempts=1).headers())]:
        room = limit - Emitter._size(key, b"", headers)  # the longest value the emitter lets through
        assert accepted(key, b"x" * room, headers), (key, headers)
        assert not accepted(key, b"x" * (room + 1), headers), (key, headers)
    real.purge()


def test_a_message_within_librdkafkas_record_overhead_does_not_stop_the_worker() -> None:
    # key + value under message.max.bytes, but not with the record overhead: produce() refused it, and the
    # worker stopped with FatalDeliveryError on every restart instead of writing an error result.
    limit = 1_000
    real, calls = _real_producer(limit), Calls()
    em = Emitter(real, "out", "dlq", "m", "v1", "json", on_done=lambda r: calls.done.append(r.offset),
                 on_failed=lambda r, e: calls.failed.append((r.offset, e)), max_message_bytes=limit)
    r = rec(8, id="r")
    out = "a" * (limit - 10 - len(em.results.encode(r, "ok", "", None, 1, 0.0,
                                                    0.0, 10.0, 0.0)) - len(r.key or b""))
    # declined: the general path handles it
    assert em.emit_ok_many([r], [out], 1, 10.0, 0.0, 10.0, 0.0) == [0]
    em.emit(Outcome(r, "ok", output=out, batch_size=1), 10.0, 0.0)  # an error result and a dead letter
    big = Record(tp=TP, offset=9, value=b"x" * (limit - 10), key=None, received_at=10.0)
    em.emit(Outcome(big, "error", error="invalid request", dlq_stage="validate"), 10.0, 0.0)  # bytes dropped
    assert em.produced == 3 and r.failed and big.failed  # (len(producer) also counts client events here)
    real.purge()


@pytest.mark.parametrize("case", ["big_key", "big_headers", "long_reason", "ok_result_with_a_big_key",
                                  "everything"])
def test_a_dead_letter_whose_key_headers_or_reason_do_not_fit_is_trimmed_until_it_does(case: str) -> None:
    # Only the original value used to be dropped: a key or headers over the producer's message.max.bytes (the
    # input topic took them) kept the dead letter too big, and produce() stopped the worker on every restart.
    limit = 1_000
    real, calls = _real_producer(limit), Calls()
    em = Emitter(real, "out", "dlq", "m", "v1", "json", on_done=lambda r: calls.done.append(r.offset),
                 on_failed=lambda r, e: calls.failed.append((r.offset, e)), max_message_bytes=limit)
    key, headers, error, status = b"k1", [("trace", b"t1")], "invalid request", "error"
    if case in ("big_key", "ok_result_with_a_big_key"):
        key = b"k" * 1_200
    elif case == "big_headers":
        headers = [("trace", b"t" * 700), ("span", b"s" * 400)]
    elif case == "long_reason":
        error = "invalid request: " + "e" * 3_000
    else:  # librdkafka's smallest message.max.bytes, the longest topic name Kafka allows
        key, headers, error = b"k" * 900, [("trace", b"t" * 950)], "invalid request: " + "e" * 3_000
    tp = TopicPartition("t" * 249, 0) if case == "everything" else TP
    r = Record(tp=tp, offset=4, value=b"v" * 300, key=key, headers=headers, received_at=10.0)
    r.id = "r"
    if status == "error" and case != "ok_result_with_a_big_key":
        em.emit(Outcome(r, "error", error=error, dlq_stage="validate"), 10.0, 0.0)
    else:
        em.emit(Outcome(r, "ok", output=1, batch_size=1), 10.0, 0.0)  # no result fits with that key
    [sent] = em.cur.sent
    assert isinstance(sent, Pending)
    # librdkafka took it (or raises)
    [(_, dl_key, value, dl_headers)] = [m for m in sent.messages if m[0] == "dlq"]
    assert value == b"" and (case not in ("big_key", "ok_result_with_a_big_key")
                             or not [m for m in sent.messages if m[0] == "out"])  # no result fits that key
    h = dict(dl_headers)
    reason = h["x-error"].decode()
    assert (
        reason.startswith("original value of 300 bytes")
        and " dropped (over message.max.bytes=1000): " in reason
    )
    if case == "big_key" or case == "ok_result_with_a_big_key":
        assert dl_key is None and ", its key (1200 bytes) dropped" in reason and h["trace"] == b"t1"
    if case == "big_headers":
        assert dl_key == b"k1" and "trace" not in h and ", its headers (" in reason
    if case == "long_reason":  # the reason is cut (the error result's too), the key and headers stay
        assert dl_key == b"k1" and h["trace"] == b"t1" and reason.endswith("e ... (cut)")
        assert h["x-error-stage"] == b"validate"
        [result] = [m for m in sent.messages if m[0] == "out"]
        assert msgspec.json.decode(result[2])["error"].endswith(" ... (cut; the dead letter has it all)")
    if case == "ok_result_with_a_big_key":
        assert h["x-error-stage"] == b"output" and "with a key of 1200 bytes" in reason
    if case == "everything":
        assert dl_key is None and "trace" not in h and reason.endswith("e ... (cut)")
        assert ", its headers (" in reason and ", its key (900 bytes)" in reason
    assert Emitter._size(dl_key, value, dl_headers) <= limit and r.failed
    real.purge()


# -------------------------------------------------------------------- a topic that takes smaller messages
TOO_LARGE = KafkaError(KafkaError.MSG_SIZE_TOO_LARGE, "Broker: Message size too large")


def _refusing(h: Harness, topic: str, over: int) -> None:
    """The broker refuses messages of ``topic`` whose value is over ``over`` bytes (the topic's
    max.message.bytes below the producer's message.max.bytes), in the delivery report as librdkafka gives
    it."""
    h.p.fail_if = lambda p: TOO_LARGE if p.topic == topic and len(p.value or b"") > over else None


def _big_second_result(monkeypatch: pytest.MonkeyPatch, **sections: Any) -> Harness:
    """Three records in in[0]; the result of offset 1 (2 kB) is over what the output topic takes (1500 B)."""
    model = FakeModel(output=lambda x: {"echo": "y" * 2000} if x == 1 else {"echo": x})
    h = Harness(monkeypatch, make_config(**sections), model=model).start()
    _refusing(h, "out", 1500)
    h.c.assign(("in", 0))
    h.send(3)
    h.process()
    _run_until_committed(h, 3)
    return h


def _run_until_committed(h: Harness, offset: int) -> None:
    for _ in range(200):
        if h.runner.fatal or h.committed() == offset:
            break
        h.process()
        h.commit()


def test_a_result_the_broker_refuses_as_too_large_becomes_an_error_result_and_a_dead_letter(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # It was re-sent as it was, refused 6 times, and the worker stopped, at every restart.
    h = _big_second_result(monkeypatch)
    assert h.runner.fatal is None and h.committed() == 3
    # not retried as is
    assert sum(1 for p in h.p.produced if p.topic == "out" and len(p.value or b"") > 1500) == 1
    results = {r["source"]["offset"]: r for r in h.p.results()}
    assert results[1]["status"] == "error" and "refused by the broker" in results[1]["error"]
    assert results[0]["status"] == results[2]["status"] == "ok"
    [dead] = h.p.dead_letters()
    assert dead.header("x-error-stage") == "output" and dead.header("x-source-offset") == "1"
    # the request itself, to replay once the topic takes it
    assert msgspec.json.decode(dead.value)["inputs"] == 1
    assert h.runner.emitter.too_large == {}  # forgotten once delivered


def test_a_dead_letter_the_broker_refuses_as_too_large_goes_without_the_original_bytes(
        monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch, make_config()).start()
    _refusing(h, "dlq", 500)
    h.c.assign(("in", 0))
    h.send(1)
    # invalid, id readable: result + dead letter
    h.c.append("in", 0, request("bad", "x" * 800, deadline_ms="nope"))
    h.send(1)
    h.process()
    _run_until_committed(h, 3)
    assert h.runner.fatal is None and h.committed() == 3
    [dead] = h.p.dead_letters()
    assert dead.value == b"" and dead.header("x-error-stage") == "validate"
    assert (dead.header("x-error") or "").startswith("original value of ")
    assert "refused by the broker: Broker: Message size too large" in (dead.header("x-error") or "")
    # (the error result went out twice: the record's messages are re-sent together, as at-least-once allows)
    assert {r["source"]["offset"]: r["status"] for r in h.p.results()} == {0: "ok", 1: "error", 2: "ok"}


def test_exactly_once_a_result_the_broker_refuses_as_too_large_is_redone_as_an_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.unit.test_runner_eos import check_transactions

    h = _big_second_result(monkeypatch, delivery={"mode": "exactly_once", "transactional_id": "t"})
    assert h.runner.fatal is None and h.committed() == 3
    assert h.p.aborted_txns  # the refusal aborted a transaction; the records were read again
    results = {r["source"]["offset"]: r for r in h.p.results()}
    assert [results[i]["status"] for i in range(3)] == ["ok", "error", "ok"]
    [dead] = h.p.dead_letters()
    assert dead.header("x-error-stage") == "output" and dead.header("x-source-offset") == "1"
    assert h.runner.emitter.too_large == {}
    check_transactions(h)


def test_a_record_whose_dead_letter_was_refused_gets_none_when_it_no_longer_owes_one(clock: FakeTime) -> None:
    # Exactly-once: a refused dead letter aborts the transaction and the record is processed again. Should it
    # now come out ok (an inference error that does not come back), it owes no dead letter, and gets none.
    p, calls = FakeProducer(), Calls()
    em = emitter(p, calls)
    r = rec(5, id="r")
    em.too_large[(r.tp, r.offset)] = "dlq"
    em.emit(Outcome(r, "ok", output=[1], batch_size=1), 10.0, 0.0)
    em.flush(1.0)
    assert [m.topic for m in p.produced] == ["out"] and not r.failed


# ----------------------------------------------------------------------------- a stalled producer is replaced
class Stalled:
    """An emitter on producers ``a`` (and spare ``b``) with a factory for replacements (``made``)."""

    def __init__(self, *, stall_s: float = 30.0, spare: bool = True, max_retries: int = 5,
                 new_held: bool = False, factory: bool = True) -> None:
        self.calls = Calls()
        self.a, self.b = FakeProducer(), FakeProducer()
        self.made: list[FakeProducer] = []
        self.replaced = 0

        def new() -> FakeProducer:
            p = FakeProducer()
            p.hold = new_held  # a broker that is down holds the new producer's messages too
            self.made.append(p)
            return p

        def counted() -> None:
            self.replaced += 1

        self.em = Emitter(self.a, "out", "dlq", "m", "v1", "json",
                          on_done=lambda r: self.calls.done.append(r.offset),
                          on_failed=lambda r, e: self.calls.failed.append((r.offset, e)),
                          max_retries=max_retries, spare_producer=self.b if spare else None,
                          new_producer=new if factory else None, stall_s=stall_s, on_replace=counted,
                          clock=_CLOCK[-1] if _CLOCK else FakeTime())

    def turn(self, clock: FakeTime, advance: float = 0.0) -> None:
        clock.advance(advance)
        self.em.retry_failed()
        self.em.poll()
        self.em.settle(clock.t)


def test_a_producer_holding_results_past_the_stall_is_replaced_and_they_are_sent_again(
    clock: FakeTime,
) -> None:
    """librdkafka#5430: after a broker pause a producer may keep a partition's messages queued for good. Past
    delivery.producer_stall_s its records are purged and re-sent on the current producer, a new producer
    takes its slot, and the old one is never polled again."""
    s = Stalled()
    s.a.hold = True  # what a holds never leaves
    ok(s.em, [0, 1], clock.t)
    s.turn(clock, 0.01)  # a has not drained: sending moves to b
    ok(s.em, [2], clock.t)
    s.turn(clock, 0.001)
    assert s.calls.done == [2]
    s.turn(clock, 29.9)
    assert (s.a.purge_calls, s.made, s.replaced) == (0, [], 0)  # not yet: 29.9 s
    s.turn(clock, 0.1)
    assert (s.a.purge_calls, len(s.made), s.replaced) == (1, 1, 1)
    assert s.em.slots[0].producer is s.made[0] and s.em.replacements == 1
    assert [r.error.code() for r in s.a.failed] == [KafkaError._PURGE_QUEUE] * 2  # type: ignore[union-attr]
    polls = s.a.poll_calls
    s.turn(clock, 1.0)  # past the retry backoff: re-sent on the current producer, b, and delivered
    s.turn(clock, 0.001)
    assert sorted(s.calls.done) == [0, 1, 2] and s.calls.failed == []
    assert [src(m) for m in s.b.produced] == [2, 0, 1]
    assert s.a.poll_calls == polls  # never polled again: its late reports cannot reach the emitter
    s.b.hold = True
    ok(s.em, [3], clock.t)  # the new producer takes its turns like the old one did
    s.turn(clock, 0.01)
    ok(s.em, [4], clock.t)
    s.b.hold = False
    s.turn(clock, 0.01)
    assert [src(m) for m in s.made[0].produced] == [4] and sorted(s.calls.done) == [0, 1, 2, 3, 4]


def src(m: Produced) -> int:
    return int(m.json()["source"]["offset"])


def test_what_a_stalled_producer_delivered_before_the_purge_is_confirmed_not_sent_again(
    clock: FakeTime,
) -> None:
    s = Stalled(spare=False)
    s.a.hold = True
    ok(s.em, [0, 1], clock.t)
    s.a.deliver(lambda m: src(m) == 0)  # 0 reached the broker; 1 is stuck
    s.turn(clock, 30.0)
    assert s.a.purge_calls == 1 and s.calls.done == [0] and [p.record.offset for p in s.em.retry_queue] == [1]
    s.turn(clock, 1.0)
    assert s.calls.done == [0, 1] and [src(m) for m in s.made[0].produced] == [1]


def test_replacements_with_nothing_delivered_between_them_wait_twice_as_long_each_time(
    clock: FakeTime,
) -> None:
    """A broker that is down holds every producer's messages: replacing them every stall_s would only churn
    connections. The wait doubles up to 8 x stall_s, and the first delivery brings it back to stall_s."""
    s = Stalled(spare=False, new_held=True, max_retries=20)
    s.a.hold = True
    ok(s.em, [0], clock.t)
    at: list[float] = []
    start = clock.t
    while len(at) < 6:
        # the purged record is re-sent a moment later on the new producer, and stalls again
        s.turn(clock, 1.0)
        if s.replaced > len(at):
            at.append(clock.t)
    gaps = [round(b - a) for a, b in zip([start, *at], at, strict=False)]
    assert gaps[0] == 30 and gaps[1:] == [61, 121, 241, 241, 241]  # +1 s: the re-send after each purge
    s.made[-1].hold = False
    s.turn(clock, 1.0)
    assert s.calls.done == [0] and s.calls.failed == []
    ok(s.em, [1], clock.t)
    s.made[-1].hold = True
    s.turn(clock, 29.0)
    assert s.replaced == 6
    s.turn(clock, 1.0)
    assert s.replaced == 7  # back to 30 s after a delivery


def test_each_purge_is_one_delivery_attempt(clock: FakeTime) -> None:
    s = Stalled(spare=False, new_held=True, max_retries=1)
    s.a.hold = True
    ok(s.em, [0], clock.t)
    for _ in range(200):
        s.turn(clock, 1.0)
        if s.calls.failed:
            break
    assert s.replaced == 2 and [o for o, _ in s.calls.failed] == [0]  # attempt 1 retried, attempt 2 gives up
    assert s.calls.failed[0][1] == ("purged from a producer replaced after holding it for "
                                    "delivery.producer_stall_s")


def test_no_replacement_without_a_factory_or_with_the_stall_off(clock: FakeTime) -> None:
    """Exactly-once has no factory (its transactional producer is not replaced); 0 turns the check off."""
    for kw in ({"factory": False}, {"stall_s": 0.0}):
        s = Stalled(spare=False, **kw)  # type: ignore[arg-type]
        s.a.hold = True
        ok(s.em, [0], clock.t)
        s.turn(clock, 3600.0)
        assert (s.a.purge_calls, s.replaced, s.calls.done) == (0, 0, [])
        s.a.hold = False
        s.turn(clock, 0.0)
        assert s.calls.done == [0]


def test_once_the_broker_is_back_a_held_producer_gets_the_stall_time_from_then(clock: FakeTime) -> None:
    """After replacements that delivered nothing (a broker down), the first delivery says the broker is back:
    a
    producer held since before then is given stall_s from then to reconnect and deliver, not replaced at once
    for the time it was held while the broker was down."""
    s = Stalled()
    s.a.hold = s.b.hold = True  # the broker is down
    t0 = clock.t
    ok(s.em, [0], clock.t)  # on a
    s.turn(clock, 0.01)
    ok(s.em, [1], clock.t)  # on b
    while s.replaced == 0:
        s.turn(clock, 1.0)
    # a replaced; the wait is 60 s now
    assert round(clock.t - t0) == 30 and s.em.slots[0].producer is s.made[0]
    s.turn(clock, 1.0)  # 0 is re-sent on the new producer (sending moved to its empty slot)...
    s.turn(clock, 0.01)  # ... which delivers it: the broker is back
    assert s.calls.done == [0]
    back = clock.t
    while s.replaced == 1 and clock.t - back < 60:
        s.turn(clock, 1.0)
    assert round(clock.t - back) == 30  # not at once, though b has held 1 since t0 (over 30 s ago)
    s.turn(clock, 1.0)
    s.turn(clock, 0.01)
    assert sorted(s.calls.done) == [0, 1] and s.calls.failed == []
