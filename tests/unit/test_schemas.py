from __future__ import annotations

from typing import Any

import msgspec
import pytest

from schemas import DeadLetter, Request, Result, Source, Timings
from schemas.export import wanted


def test_request_round_trip_json_and_msgpack():
    r = Request[Any](id="a", inputs={"text": "hi"}, priority="high", deadline_ms=123, meta={"k": 1})
    for enc, dec in ((msgspec.json.encode, msgspec.json.decode),
                     (msgspec.msgpack.encode, msgspec.msgpack.decode)):
        assert dec(enc(r), type=Request[Any]) == r


def test_request_is_tolerant_of_new_fields_and_strict_on_required():
    r = msgspec.json.decode(b'{"id":"x","inputs":1,"future_field":true}', type=Request[Any])
    assert r.id == "x" and r.priority is None
    with pytest.raises(msgspec.ValidationError, match=r"missing required field `inputs`"):
        msgspec.json.decode(b'{"id":"x"}', type=Request[Any])
    with pytest.raises(msgspec.ValidationError, match=r"\$.id"):
        msgspec.json.decode(b'{"id":"","inputs":1}', type=Request[Any])


def test_request_validates_typed_inputs_with_path():
    with pytest.raises(msgspec.ValidationError, match=r"\$.inputs\[1\]"):
        msgspec.json.decode(b'{"id":"x","inputs":[1.0,"two"]}', type=Request[list[float]])


def test_result_round_trip():
    res = Result(id="a", status="ok", outputs=[0.1, 0.2], model="tiny", lane="default", batch_size=8,
                 source=Source(topic="t", partition=1, offset=42),
                 timings=Timings(queue_ms=1.5, total_ms=3.0))
    assert msgspec.json.decode(msgspec.json.encode(res), type=Result) == res
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(res), type=Result) == res


def test_dead_letter_headers_round_trip():
    dl = DeadLetter(error="boom", error_stage="inference", source_topic="t", source_partition=3,
                    source_offset=99, attempts=2)
    assert DeadLetter.from_headers(dl.headers()) == dl
    with pytest.raises(ValueError, match="missing headers"):
        DeadLetter.from_headers([("x-error", b"e")])


def test_exported_schemas_are_in_sync():
    stale = [str(p) for p, text in wanted().items() if not p.exists() or p.read_text() != text]
    assert not stale, f"stale schema files, run `python -m schemas.export`: {stale}"
