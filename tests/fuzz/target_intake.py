"""Fuzz target ``intake``: a consumed record (value bytes, key, headers, topic) through the worker's real
intake (size limit, decoding, validation, lane routing, the model's decode) and then through the Emitter's
result and dead-letter encoding, as the runner does with what admit() gives it.

What must hold for every input: admit() returns (never raises) within a bounded time; a rejected record
carries a dead-letter stage and a reason; every message handed to the producer fits in message.max.bytes (a
real producer raises for a bigger one, and the worker would stop at every restart on the same record); a
dead letter's headers read back as the stage and source they were written with; a result decodes and
echoes the request id.
"""

from __future__ import annotations

import time
from typing import Any, get_args

import msgspec
from hypothesis import strategies as st

from schemas import H_PRIORITY, DeadLetter, ErrorStage, Result
from worker.config.settings import from_dict
from worker.core.records import Outcome, Record, TopicPartition
from worker.output.emit import Emitter
from worker.pipeline.intake import Intake

MAX_BYTES = 4096  # delivery.max_input_bytes here: small, so that generated records cross it
MESSAGE_MAX = 1000  # librdkafka's smallest message.max.bytes: the hardest case for the dead letters
LANES = [{"name": "high", "priority": 2, "topics": ["in-high"]}, {"name": "bulk", "deadline_ms": 60_000},
         {"name": "default"}]
TOPICS = ["in-high", "in", "in-unknown"]
STAGES = set(get_args(ErrorStage))
BOUND_S = 2.0  # for one record through admit() and emit(); the worst seen is far below (see fuzz report)


class CaptureProducer:
    """Takes what the Emitter produces and checks it as librdkafka's produce() would (the size)."""

    def __init__(self, message_max: int = MESSAGE_MAX) -> None:
        self.message_max = message_max
        self.sent: list[tuple[str, bytes | None, bytes | None, list[tuple[str, bytes]] | None]] = []

    def produce(self, topic: str, value: bytes | None = None, key: bytes | None = None, *args: Any,
                headers: list[tuple[str, bytes]] | None = None, **_kw: Any) -> None:
        size = Emitter._size(key, value, headers)
        assert size <= self.message_max, (
            f"a {size}-byte message to {topic} (message.max.bytes={self.message_max})")
        self.sent.append((topic, key, value, headers))

    def poll(self, _timeout: float = 0) -> int:
        return 0

    def flush(self, _timeout: float = 0) -> int:
        return 0

    def __len__(self) -> int:
        return 0


def _model() -> Any:
    from worker.models.tiny import TinyModel

    return TinyModel()


_MODEL: list[Any] = []
_INTAKES: dict[tuple[str, int], Intake] = {}


def intake(fmt: str, max_input_bytes: int = MAX_BYTES) -> Intake:
    if (fmt, max_input_bytes) not in _INTAKES:
        if not _MODEL:
            _MODEL.append(_model())
        cfg = from_dict({"kafka": {"input_topics": ["in", "in-unknown"]},
                         "batching": {"lanes": LANES},
                         "delivery": {"format": fmt, "max_input_bytes": max_input_bytes},
                         "redis": {"cache": True}}, environ={})
        _INTAKES[fmt, max_input_bytes] = Intake(cfg, _MODEL[0])
    return _INTAKES[fmt, max_input_bytes]


# ------------------------------------------------------------------------------------------- strategies
_scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
            | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=40))
_json_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=5)
                            | st.dictionaries(st.text(max_size=10), inner, max_size=5), max_leaves=30)
_ext = st.builds(msgspec.msgpack.Ext, st.integers(-128, 127), st.binary(max_size=20))
_msgpack_values = st.recursive(_scalars | _ext | st.binary(max_size=20),
                               lambda inner: st.lists(inner, max_size=5)
                               | st.dictionaries(st.text(max_size=10), inner, max_size=5), max_leaves=30)
_floats16 = st.lists(st.floats(allow_nan=True, allow_infinity=True, width=64), min_size=14, max_size=18)


def _deep(fmt: str, depth: int, field: str) -> bytes:
    """A request whose ``field`` nests ``depth`` lists deep, written as bytes (no encoder goes that deep)."""
    if fmt == "json":
        return b'{"id": "deep", "' + field.encode() + b'": ' + b"[" * depth + b"0" + b"]" * depth + b"}"
    head = msgspec.msgpack.encode({"id": "deep"})  # a fixmap of 1: make it 2 and append the field
    return bytes([head[0] + 1]) + head[1:] + msgspec.msgpack.encode(field) + b"\x91" * depth + b"\x00"


@st.composite
def requests(draw: st.DrawFn, fmt: str) -> bytes:
    """A request-shaped value: mostly well-formed, with hostile fields, then maybe mutated bytes."""
    values = _json_values if fmt == "json" else _msgpack_values
    if draw(st.integers(0, 9)) == 0:
        field = draw(st.sampled_from(["inputs", "meta", "priority", "x"]))
        return _deep(fmt, draw(st.integers(1, 5000)), field)
    body: dict[str, Any] = {}
    if draw(st.integers(0, 9)):
        body["id"] = draw(st.text(max_size=20) | st.text(min_size=500, max_size=600) | values)
    if draw(st.integers(0, 9)):
        body["inputs"] = draw(_floats16 | values)
    if draw(st.booleans()):
        body["priority"] = draw(st.sampled_from(["high", "bulk", "default", "", " high ", "nope"]) | values)
    if draw(st.booleans()):
        body["deadline_ms"] = draw(st.integers(-(2**64), 2**64) | values)
    if draw(st.booleans()):
        body["meta"] = draw(values)
    for k in draw(st.lists(st.text(max_size=8), max_size=3)):
        body[k] = draw(values)
    try:
        raw = (msgspec.json.encode(body) if fmt == "json" else msgspec.msgpack.encode(body))
    except (OverflowError, TypeError, ValueError, msgspec.EncodeError):  # an int past 64 bits, a NaN key...
        raw = repr(body).encode()[:MAX_BYTES * 2]
    how = draw(st.sampled_from(["as-is", "as-is", "truncate", "flip", "splice", "raw"]))
    if how == "truncate" and raw:
        raw = raw[:draw(st.integers(0, len(raw) - 1))]
    elif how == "flip" and raw:
        i = draw(st.integers(0, len(raw) - 1))
        raw = raw[:i] + bytes([raw[i] ^ draw(st.integers(1, 255))]) + raw[i + 1:]
    elif how == "splice":
        i = draw(st.integers(0, len(raw)))
        raw = raw[:i] + draw(st.binary(max_size=16)) + raw[i:]
    elif how == "raw":
        raw = draw(st.binary(max_size=200))
    return raw


_header_keys = st.sampled_from([H_PRIORITY, "x-error", "x-error-stage", "x-source-topic", "x-attempts",
                                "traceparent"]) | st.text(max_size=12)
headers = st.lists(st.tuples(_header_keys, st.binary(max_size=40) | st.sampled_from([b"high", b"bulk", b""])),
                   max_size=6)
keys = st.none() | st.binary(max_size=40) | st.binary(min_size=900, max_size=1100)


def records(fmt: str) -> st.SearchStrategy[tuple[bytes | None, bytes | None, list[tuple[str, bytes]], str]]:
    return st.tuples(st.none() | requests(fmt), keys, headers, st.sampled_from(TOPICS))


# ------------------------------------------------------------------------------------------------ check
def check(fmt: str, value: bytes | None, key: bytes | None, hdrs: list[tuple[str, bytes]], topic: str, *,
          max_input_bytes: int = MAX_BYTES, message_max: int = MESSAGE_MAX,
          bound_s: float = BOUND_S) -> Outcome:
    """The checks above for one record; returns the outcome as the Emitter sent it."""
    it = intake(fmt, max_input_bytes)
    now, wall_ms = 5000.0, time.time() * 1000
    rec = Record(tp=TopicPartition(topic, 3), offset=41, value=value,  # type: ignore[arg-type]
                 key=key, headers=list(hdrs), received_at=now - 0.001)
    t0 = time.perf_counter()
    o = it.admit(rec, now)
    assert rec.lane in it.lanes, rec.lane
    if o is None:
        assert rec.id is not None and rec.item is not None
        o = Outcome(rec, "ok", output=[0.25] * 4, batch_size=1, timings={"queue": 0.001, "infer": 0.002})
    else:
        assert o.dlq_stage in STAGES and o.error, (o.dlq_stage, o.error)
    producer = CaptureProducer(message_max)
    emitter = Emitter(producer, "out", "dlq", "tiny", "1", fmt, on_done=lambda r: None,
                      on_failed=lambda r, why: None, max_message_bytes=message_max)
    sent = emitter.emit(o, now, wall_ms)
    took = time.perf_counter() - t0
    assert took < bound_s, f"{took:.2f} s for one record"
    dec = msgspec.json.Decoder(Result) if fmt == "json" else msgspec.msgpack.Decoder(Result)
    to_dlq = [m for m in producer.sent if m[0] == "dlq"]
    results = [m for m in producer.sent if m[0] == "out"]
    assert len(to_dlq) == (1 if sent.dlq_stage else 0), (sent.dlq_stage, producer.sent)
    for _t, _k, _v, h in to_dlq:
        dl = DeadLetter.from_headers(h)
        assert (dl.error_stage, dl.source_topic, dl.source_partition, dl.source_offset) == (
            sent.dlq_stage, topic, 3, 41)
    if sent.dlq_stage is None:
        assert len(results) == 1
    for _t, _k, v, _h in results:
        assert v is not None
        res = dec.decode(v)
        assert res.id == (rec.id or "") and res.status == sent.status
    return sent
