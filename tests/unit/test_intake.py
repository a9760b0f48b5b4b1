"""Intake: consumed bytes -> a routed Record, or an Outcome for the DLQ (bad input
never blocks a partition). Unit tests of ``Intake.admit`` and, through the runner, of what reaches the
output and dead-letter topics and the commit."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated, Any

import msgspec
import pytest

from schemas import H_PRIORITY, DeadLetter
from tests.unit.fakes_kafka import FakeModel, FakeTime, Harness, make_config, request
from worker.core.records import Record, TopicPartition
from worker.pipeline.intake import Intake

IN0 = TopicPartition("in", 0)


class Point(msgspec.Struct, forbid_unknown_fields=True):
    x: Annotated[float, msgspec.Meta(ge=0)]


LANES = {"lanes": [{"name": "hi", "priority": 1, "topics": ["in-hi"]},
                   {"name": "bulk", "deadline_ms": 500},
                   {"name": "default"}]}


# The fake clock of the running test: ``intake()`` hands it to the Intake it builds (``clock=``).
_CLOCK: list[FakeTime] = []


@pytest.fixture
def clock() -> Iterator[FakeTime]:
    c = FakeTime()
    _CLOCK.append(c)
    yield c
    _CLOCK.remove(c)


def intake(handler: FakeModel | None = None, **sections: dict[str, Any]) -> Intake:
    sections.setdefault("batching", LANES)
    return Intake(make_config(**sections), handler or FakeModel(input_type=Point),
                  clock=_CLOCK[-1] if _CLOCK else FakeTime())


def record(value: bytes | None, topic: str = "in", headers: list[tuple[str, bytes]] | None = None,
           received_at: float = 1000.0) -> Record:
    return Record(tp=TopicPartition(topic, 0), offset=7, value=value, headers=headers or [],  # type: ignore[arg-type]
                  received_at=received_at)


def test_a_valid_request_is_routed_and_decoded(clock: FakeTime) -> None:
    rec = record(request("r1", {"x": 1.5}, meta={"trace": "t"}))
    assert intake().admit(rec, clock.t) is None
    assert (rec.id, rec.item, rec.lane, rec.meta, rec.deadline) == ("r1", Point(1.5), "default",
                                                                    {"trace": "t"}, None)


def test_size_limit(clock: FakeTime) -> None:
    it = intake(delivery={"max_input_bytes": 64})
    ok = request("r", {"x": 1})
    # at the limit: fine
    assert intake(delivery={"max_input_bytes": len(ok)}).admit(record(ok), clock.t) is None
    rec = record(request("big", {"x": 1}, meta={"pad": "x" * 100}))
    o = it.admit(rec, clock.t)
    assert o is not None and (o.status, o.dlq_stage) == ("error", "size")
    assert "max_input_bytes=64" in (o.error or "")
    assert rec.id is None  # not decoded at all: no result, the dead letter only


@pytest.mark.parametrize("value", [b"{not json", b"\xff\xfe", b"", b'{"id": "x", "inputs"'])
def test_undecodable(clock: FakeTime, value: bytes) -> None:
    o = intake().admit(record(value), clock.t)
    assert o is not None and (o.status, o.dlq_stage, o.record.id) == ("error", "decode", None)
    assert (o.error or "").startswith("undecodable json")


def test_undecodable_msgpack(clock: FakeTime) -> None:
    o = intake(delivery={"format": "msgpack"}).admit(record(b"\xc1garbage"), clock.t)
    assert o is not None and o.dlq_stage == "decode" and "msgpack" in (o.error or "")


def test_tombstone(clock: FakeTime) -> None:
    o = intake().admit(record(None), clock.t)
    assert o is not None and o.dlq_stage == "decode" and "tombstone" in (o.error or "")


@pytest.mark.parametrize(("inputs", "path"), [({"x": -1}, "$.inputs.x"), ({"x": "one"}, "$.inputs.x"),
                                              ({"y": 1}, "$.inputs"), (3, "$.inputs")])
def test_invalid_request_names_the_field_path_and_keeps_the_id(clock: FakeTime, inputs: Any,
                                                               path: str) -> None:
    rec = record(request("r9", inputs))
    o = intake().admit(rec, clock.t)
    assert o is not None and (o.status, o.dlq_stage) == ("error", "validate")
    assert f"at `{path}" in (o.error or ""), o.error
    assert rec.id == "r9"  # salvaged: the requester gets an error result


@pytest.mark.parametrize("value", [request(None, {"x": 1}), b'{"id": 5, "inputs": {"x": 1}}',
                                   b'{"id": "", "inputs": {"x": 1}}'])
def test_invalid_request_without_a_usable_id(clock: FakeTime, value: bytes) -> None:
    rec = record(value)
    o = intake().admit(rec, clock.t)
    assert o is not None and o.dlq_stage == "validate"
    assert not rec.id  # no (usable) id: the dead letter only


def test_lane_routing_by_topic_header_and_field(clock: FakeTime) -> None:
    it = intake()
    cases = [
        (record(request("a", {"x": 1}), topic="in-hi"), "hi"),  # topic -> lane
        (record(request("b", {"x": 1}, priority="bulk")), "bulk"),  # request field
        # header first
        (record(request("c", {"x": 1}, priority="bulk"), headers=[(H_PRIORITY, b"hi")]), "hi"),
        (record(request("d", {"x": 1})), "default"),
    ]
    for rec, lane in cases:
        assert it.admit(rec, clock.t) is None
        assert rec.lane == lane, rec.id
    assert it.unknown_lane_count == 0


@pytest.mark.parametrize("where", ["header", "field"])
def test_an_unknown_lane_goes_to_the_default_lane(clock: FakeTime, where: str) -> None:
    it = intake()
    if where == "header":
        rec = record(request("a", {"x": 1}), topic="in-hi", headers=[(H_PRIORITY, b"nope")])
    else:
        rec = record(request("a", {"x": 1}, priority="nope"), topic="in-hi")
    assert it.admit(rec, clock.t) is None  # not an error
    assert rec.lane == "default" and it.unknown_lane_count == 1


def test_deadlines(clock: FakeTime) -> None:
    it = intake()
    past = record(request("late", {"x": 1}, deadline_ms=clock.time_ms() - 1))
    o = it.admit(past, clock.t)
    assert o is not None and (o.status, o.dlq_stage) == ("expired", "expired") and past.id == "late"

    future = record(request("soon", {"x": 1}, deadline_ms=clock.time_ms() + 250))
    assert it.admit(future, clock.t) is None
    assert future.deadline == pytest.approx(clock.t + 0.25, abs=0.002)  # wall clock -> the monotonic clock

    budget = record(request("b", {"x": 1}, priority="bulk"), received_at=clock.t - 0.1)
    assert it.admit(budget, clock.t) is None
    assert budget.deadline == pytest.approx(clock.t - 0.1 + 0.5)  # the lane's deadline_ms from receipt

    spent = record(request("s", {"x": 1}, priority="bulk"), received_at=clock.t - 0.6)
    o = it.admit(spent, clock.t)
    assert o is not None and o.status == "expired"  # the lane budget ran out before it was read


def test_model_decode_failure_is_a_decode_error(clock: FakeTime) -> None:
    rec = record(request("m", "undecodable-by-model"))
    o = intake(FakeModel()).admit(rec, clock.t)
    assert o is not None and o.dlq_stage == "decode" and "model decode failed: ValueError" in (o.error or "")
    assert rec.id == "m"


def test_cache_key_is_canonical_and_only_with_the_cache_on(clock: FakeTime) -> None:
    a, b, c = (record(request("a", {"p": 1, "q": [1, 2]})),
               record(b'{"inputs": {"q": [1, 2], "p": 1}, "id": "b"}'),
               record(request("c", {"p": 2, "q": [1, 2]})))
    on = intake(FakeModel(), redis={"cache": True})
    for r in (a, b, c):
        assert on.admit(r, clock.t) is None
    assert a.cache_key is not None and a.cache_key == b.cache_key != c.cache_key
    other_version = intake(FakeModel(), redis={"cache": True}, model={"version": "2"})
    d = record(request("d", {"p": 1, "q": [1, 2]}))
    assert other_version.admit(d, clock.t) is None and d.cache_key != a.cache_key
    off = record(request("e", {"p": 1}))
    assert intake(FakeModel()).admit(off, clock.t) is None and off.cache_key is None


# ------------------------------------------------------------------------------------------ through the
# runner
def test_rejected_records_go_to_the_dlq_with_their_bytes_and_never_block_the_partition(
        monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = make_config(delivery={"max_input_bytes": 200}, batching=LANES)
    h = Harness(monkeypatch, cfg, model=FakeModel(input_type=Point)).start()
    h.c.assign(("in", 0))
    now_ms = h.clock.time_ms()
    values: list[bytes | None] = [
        request("ok-0", {"x": 1}),
        request("big", {"x": 1}, meta={"pad": "x" * 300}),  # 1 size
        b"\x00not json",  # 2 decode
        request("bad", {"x": -5}),  # 3 validate (id salvaged)
        request("late", {"x": 1}, deadline_ms=now_ms - 10),  # 4 expired
        request("lost-lane", {"x": 2}, priority="nope"),  # 5 fine: default lane
        None,  # 6 tombstone
        request("ok-7", {"x": 3}),
    ]
    for i, v in enumerate(values):
        h.c.append("in", 0, v, key=f"k{i}".encode(), headers=[("trace", b"t%d" % i), ("x-error", b"old")])
    h.process()
    h.commit()
    assert h.committed() == len(values)  # nothing blocks the partition
    assert [x for batch in h.model.forward_calls for x in batch] == [Point(1), Point(2), Point(3)]

    results = {r["id"]: r for r in h.p.results()}
    assert set(results) == {"ok-0", "bad", "late", "lost-lane", "ok-7"}
    assert results["bad"]["status"] == "error" and "$.inputs.x" in results["bad"]["error"]
    assert results["late"]["status"] == "expired"
    assert results["lost-lane"]["status"] == "ok" and results["lost-lane"]["lane"] == "default"
    assert h.runner.intake.unknown_lane_count == 1

    dead = {int(p.header("x-source-offset") or -1): p for p in h.p.dead_letters()}
    assert {o: p.header("x-error-stage") for o, p in dead.items()} == {
        1: "size", 2: "decode", 3: "validate", 4: "expired", 6: "decode"}
    for off, p in dead.items():
        assert p.value == values[off] and p.key == f"k{off}".encode()  # the original bytes and key
        assert p.header("trace") == f"t{off}"  # original headers kept ...
        assert [k for k, _ in p.headers or []].count("x-error") == 1  # ... except stale x-error ones
        dl = DeadLetter.from_headers(p.headers)
        assert (dl.source_topic, dl.source_partition, dl.source_offset) == ("in", 0, off)
    assert "$.inputs.x" in (dead[3].header("x-error") or "")
    assert h.runner.stats.dlq == 5 and h.runner.stats.results_expired == 1


def test_nesting_deeper_than_the_decoder_allows_is_a_decode_error(clock: FakeTime) -> None:
    # msgspec raises RecursionError here, not DecodeError: it used to escape admit() and stop the worker on
    # every restart (the record is never committed past).
    deep = b'{"id": "deep", "inputs": {"x": 1}, "meta": {"m": ' + b"[" * 5000 + b"]" * 5000 + b"}}"
    o = intake().admit(record(deep), clock.t)
    assert o is not None and (o.status, o.dlq_stage) == ("error", "decode")
    assert "recursion" in (o.error or "")


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_an_invalid_request_that_nests_too_deep_after_the_bad_field_is_a_validate_error(
        clock: FakeTime, fmt: str) -> None:
    # The main decode stops at the invalid field (ValidationError); salvaging the id then reads the whole
    # value and hit the depth limit (RecursionError), which escaped admit() and stopped the worker on every
    # restart.
    if fmt == "json":
        deep = (
            b'{"inputs": 1, "deadline_ms": "x", "id": "a", "meta": {"k": ' + b"[" * 5000 + b"]" * 5000 + b"}}"
        )
    else:
        # msgspec cannot write this deep either: the msgpack bytes by hand (fixarray of 1 element = 0x91).
        deep = (b"\x84\xa6inputs\x01\xabdeadline_ms\xa1x\xa2id\xa1a\xa4meta\x81\xa1k"
                + b"\x91" * 5000 + b"\x90")
    o = intake(delivery={"format": fmt}).admit(record(deep), clock.t)
    assert o is not None and (o.status, o.dlq_stage) == ("error", "validate")
    assert o.record.id is None  # no id could be read: a dead letter only


def test_inputs_msgpack_cannot_write_are_not_cached_but_processed(clock: FakeTime) -> None:
    rec = record(request("big-int", [2**70, 1]))
    assert intake(FakeModel(), redis={"cache": True}).admit(rec, clock.t) is None
    assert rec.cache_key is None and rec.item == [2**70, 1]


def test_a_record_rejected_before_routing_is_counted_under_a_lane_that_exists(clock: FakeTime) -> None:
    """Decode and validate rejections return before routing: they kept the Record default "default", a lane
    that need not exist (results and kiw_records_out_total{lane="default"} under a lane nobody configured)."""
    it = intake(batching={"lanes": [{"name": "hi", "priority": 1, "topics": ["in-hi"]}, {"name": "bulk"}],
                          "default_lane": "bulk"})
    for topic, value, lane in (("in", b"{bad", "bulk"), ("in-hi", b"{bad", "hi"),
                               ("in", b'{"id": "a"}', "bulk")):
        o = it.admit(record(value, topic=topic), clock.t)
        assert o is not None and o.record.lane == lane, (topic, value, o.record.lane)


class _Events:
    def __init__(self) -> None:
        self.events: list[tuple[str, int, dict[str, str]]] = []

    def event(self, name: str, n: int = 1, **labels: str) -> None:
        self.events.append((name, n, labels))


def test_unknown_lanes_are_exported_and_logged_per_report_not_per_record(
        clock: FakeTime, caplog: pytest.LogCaptureFixture) -> None:
    it = intake()
    for i in range(3):
        assert it.admit(record(request(f"a{i}", {"x": 1}, priority="nope")), clock.t) is None
    assert it.admit(record(request("b", {"x": 1}), topic="in-hi", headers=[(H_PRIORITY, b" gone ")]),
                    clock.t) is None
    assert it.admit(record(request("c", {"x": 1}, priority="bulk")), clock.t) is None  # a known lane
    m = _Events()
    with caplog.at_level("WARNING", logger="worker.intake"):
        it.report_unknown_lanes(m)  # type: ignore[arg-type]
        it.report_unknown_lanes(m)  # type: ignore[arg-type]  # nothing new: no event, no line
    assert sorted(m.events, key=lambda e: e[2]["topic"]) == [("unknown_lane", 3, {"topic": "in"}),
                                                            ("unknown_lane", 1, {"topic": "in-hi"})]
    [line] = caplog.records
    assert "4 records named a lane that does not exist" in line.getMessage()
    assert "'gone'" in line.getMessage() and "'nope'" in line.getMessage()
    assert it.unknown_lane_count == 4


def test_unknown_lanes_reach_the_metrics_at_the_lag_report(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.observability.metrics import PrometheusMetrics

    m = PrometheusMetrics()
    h = Harness(monkeypatch, make_config(batching=LANES), metrics=m).start()
    h.c.assign(("in", 0))
    h.c.append("in", 0, request("x", 1, priority="nope"))
    h.iterate()  # the first turn reports
    assert m.registry.get_sample_value("kiw_unknown_lane_total", {"topic": "in"}) == 1


def test_unknown_lanes_since_the_last_report_are_reported_at_shutdown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from worker.observability.metrics import PrometheusMetrics

    m = PrometheusMetrics()
    h = Harness(monkeypatch, make_config(batching=LANES), metrics=m).start()
    h.c.assign(("in", 0))
    h.iterate()  # the first turn's lag report, nothing unknown yet
    h.c.append("in", 0, request("x", 1, priority="nope"))
    h.iterate()  # read; the next lag report is lag_interval_s away
    assert m.registry.get_sample_value("kiw_unknown_lane_total", {"topic": "in"}) is None
    h.runner.shutdown()
    assert m.registry.get_sample_value("kiw_unknown_lane_total", {"topic": "in"}) == 1


@pytest.mark.parametrize("deadline", ["1" + "0" * 309, "-1" + "0" * 309, str(2**53 + 1)])
def test_a_deadline_beyond_any_clock_is_a_validation_error(clock: FakeTime, deadline: str) -> None:
    """A 309-digit deadline_ms decoded as a Python int and raised OverflowError in admit (float arithmetic):
    the loop ended, at every restart, for whichever worker took the partition."""
    out = intake().admit(
        record(b'{"id": "d", "inputs": {"x": 1}, "deadline_ms": ' + deadline.encode() + b"}"), 1000.0
    )
    assert out is not None and out.dlq_stage == "validate" and "deadline_ms" in (out.error or "")
    assert out.record.id == "d"  # its sender still gets an error result


def test_meta_nested_as_deep_as_the_decoder_allows_gets_an_error_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Admitted (within the decoder's limit), but the result echoes meta one level deeper and cannot be
    encoded; the error result that replaces it echoed the same meta and raised out of the loop. The deepest
    meta the worker's decoder takes depends on the call stack: found by trying, from too deep downwards."""
    for depth in range(1100, 700, -2):
        h = Harness(monkeypatch).start()
        h.c.assign(("in", 0))
        h.c.append("in", 0, _deep(depth))
        h.process()
        h.commit()
        stages = [d.header("x-error-stage") for d in h.p.dead_letters()]
        if stages != ["decode"]:
            break
    [res] = h.p.results()
    assert res["status"] == "error" and "not encodable" in res["error"] and res.get("meta") is None
    assert stages == ["output"] and h.committed() == 1


def _deep(depth: int) -> bytes:
    return ('{"id":"deep","inputs":1,"meta":{"k":' + "[" * depth + "1" + "]" * depth + "}}").encode()


def test_a_panic_in_the_model_decode_is_a_decode_error(clock: FakeTime) -> None:
    """pyo3 raises a Rust panic (a tokenizer's, say) as PanicException, a BaseException: it escaped admit() on
    the loop thread, before any attempt was counted, and stopped the worker at every restart."""
    class PanicException(BaseException):
        pass

    class Panicking(FakeModel):
        def decode(self, inputs: Any) -> Any:
            raise PanicException("called `Option::unwrap()` on a `None` value")

    o = intake(Panicking()).admit(record(request("p", 1)), clock.t)
    assert o is not None and (o.status, o.dlq_stage) == ("error", "decode")
    assert "PanicException" in (o.error or "")

    class Stopping(FakeModel):
        def decode(self, inputs: Any) -> Any:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # still stops the worker
        intake(Stopping()).admit(record(request("s", 1)), clock.t)
