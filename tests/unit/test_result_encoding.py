"""ResultEncoder and ``delivery.outputs_encoding: float32``: which outputs are packed, their bytes, and the
batch encoder writing byte for byte what the one-record encoder writes."""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from schemas import Float32Tensor, Result
from worker.core.records import Record, TopicPartition
from worker.output.result_encoding import UNENCODABLE, ResultEncoder, pack_float32

TP = TopicPartition("in", 1)
f32 = st.floats(width=32, allow_nan=False)


def rec(offset: int, **kw: Any) -> Record:
    r = Record(TP, offset, b"{}", b"k", [], 10.0, 1_000 + offset, 0)
    r.id, r.lane = f"r-{offset}", "hi"
    for k, v in kw.items():
        setattr(r, k, v)
    return r


def floats_of(t: Float32Tensor) -> list[float]:
    return list(struct.unpack(f"<{len(t.data) // 4}f", t.data))


@given(st.lists(f32, min_size=1, max_size=50))
def test_a_list_of_floats_is_packed_as_little_endian_float32(xs: list[float]) -> None:
    t = pack_float32(xs)
    assert isinstance(t, Float32Tensor) and (t.dtype, t.shape) == ("float32", [len(xs)])
    assert floats_of(t) == xs  # float32 values survive exactly


@given(st.integers(1, 5), st.integers(0, 4), st.data())
def test_nested_lists_of_one_shape_are_packed_row_major(rows: int, cols: int, data: st.DataObject) -> None:
    m = [data.draw(st.lists(f32, min_size=cols, max_size=cols)) for _ in range(rows)]
    t = pack_float32(m)
    assert isinstance(t, Float32Tensor) and t.shape == [rows, cols]
    assert floats_of(t) == [x for row in m for x in row]


@pytest.mark.parametrize("output", [
    {"label": "pos", "score": 0.9},  # a dict of labels
    [{"label": "pos", "score": 0.9}],
    "text", 0.5, 3, None, [],
    [1, 2, 3],  # ints keep their exact values
    [True, False], [0.5, 1], [0.5, "x"],  # bools, mixed types
    [[0.5, 0.25], [0.5]],  # ragged
    [[0.5], [[0.5]]],  # depths differ
    [[0.5], 0.5],
])
def test_what_is_not_a_numeric_array_is_left_as_it_is(output: Any) -> None:
    assert pack_float32(output) is output


def test_an_array_with_astype_and_tobytes_is_packed_by_its_shape() -> None:
    np = pytest.importorskip("numpy")
    a = np.arange(6, dtype=np.float64).reshape(2, 3) / 4
    t = pack_float32(a)
    assert isinstance(t, Float32Tensor) and t.shape == [2, 3]
    assert floats_of(t) == [0, 0.25, 0.5, 0.75, 1, 1.25]
    strings = np.array(["a", "b"])
    assert pack_float32(strings) is strings


def test_a_value_beyond_float32_becomes_inf_not_an_error() -> None:
    t = pack_float32([1e300, -1e300])
    assert isinstance(t, Float32Tensor) and floats_of(t) == [math.inf, -math.inf]


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_the_result_carries_dtype_shape_and_the_bytes(fmt: str) -> None:
    enc = ResultEncoder("m", "1", fmt, "float32")
    value = enc.encode(rec(3), "ok", [0.5, -2.0, 0.25], None, 1, 0.0, 0.0, 10.5, 2_000.0)
    res = (msgspec.json.decode(value) if fmt == "json" else msgspec.msgpack.decode(value))
    out = res["outputs"]
    data = base64.b64decode(out["data"]) if fmt == "json" else out["data"]
    assert (out["dtype"], out["shape"], data) == ("float32", [3], struct.pack("<3f", 0.5, -2.0, 0.25))
    msgspec.json.decode(value, type=Result) if fmt == "json" else msgspec.msgpack.decode(value, type=Result)


@pytest.mark.parametrize("encoding", ["lists", "float32"])
@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_the_batch_encoder_writes_what_the_one_record_encoder_writes(fmt: str, encoding: str) -> None:
    enc = ResultEncoder("m", None, fmt, encoding)  # type: ignore[arg-type]
    recs = [rec(0), rec(1, meta={"u": 1}), rec(2, produced_at_ms=None), rec(3)]
    outs: list[Any] = [[0.5, 0.25], {"label": "x"}, [[1.5], [2.5]], object()]
    values = enc.encode_ok(recs, outs, 4, 10.002, 0.01, 10.5, 2_000.0)
    assert values[3] is None  # not encodable: the caller sends that record an error instead
    for i in range(3):
        assert values[i] == enc.encode(recs[i], "ok", outs[i], None, 4, 10.002 - 10.0, 0.01, 10.5, 2_000.0)


def test_lists_is_the_default_and_sends_outputs_as_they_are() -> None:
    enc = ResultEncoder("m", "1", "json")
    value = enc.encode(rec(0), "ok", [0.5, 0.25], None, 1, 0.0, 0.0, 10.5, 2_000.0)
    assert msgspec.json.decode(value)["outputs"] == [0.5, 0.25]


def test_the_runner_packs_numeric_outputs_also_of_cache_hits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the worker's loop: ``delivery.outputs_encoding: float32`` packs a list of floats, whether the
    batch path sends it or the general path (a cache hit); a dict output is sent as it is."""
    from tests.unit.fakes_kafka import FakeModel, Harness, make_config, request
    from worker.store.memory_store import MemoryStore

    model = FakeModel(output=lambda x: [float(v) / 4 for v in x["v"]] if x["v"] else {"label": "none"})
    cfg = make_config(redis={"cache": True}, delivery={"outputs_encoding": "float32"})
    h = Harness(monkeypatch, cfg, model=model, store=MemoryStore(ledger=False)).start()
    h.c.assign(("in", 0))
    h.c.append("in", 0, request("a", {"v": [1, 2, 3]}))
    h.c.append("in", 0, request("e", {"v": []}))
    h.process()
    h.c.append("in", 0, request("b", {"v": [1, 2, 3]}))  # the same inputs: from the cache
    h.process()
    h.commit()
    results: dict[str, Any] = {r["id"]: r for r in h.p.results()}
    for rid in ("a", "b"):
        out = results[rid]["outputs"]
        assert (out["dtype"], out["shape"]) == ("float32", [3])
        assert base64.b64decode(out["data"]) == struct.pack("<3f", 0.25, 0.5, 0.75)
    assert results["b"]["cached"] is True and results["e"]["outputs"] == {"label": "none"}
    assert h.committed() == 3


_texts = st.text(alphabet=st.sampled_from("ab\n\r\"\\\u2028é\x00"), max_size=6)
_outputs = st.one_of(st.none(), _texts, st.lists(st.floats(allow_nan=False), max_size=3),
                     st.dictionaries(_texts, st.integers(-(2**63), 2**63 - 1), max_size=2),
                     st.just(2**70), st.builds(object),
                     # pre-encoded output with newlines of its own
                     st.builds(msgspec.Raw, st.sampled_from([b'{\n"a": 1}', b"[1,\n2]", b'"x"'])))


@given(st.sampled_from(["json", "msgpack"]), st.sampled_from(["lists", "float32"]),
       st.lists(st.tuples(_outputs, st.sampled_from([10.0, 10.25]), st.sampled_from([None, 1_000, 1_001]),
                          _texts), min_size=1, max_size=8))
def test_every_batch_encodes_each_result_as_the_one_record_encoder_does(
        fmt: str, encoding: str, cases: list[tuple[Any, float, int | None, str]]) -> None:
    """Records that share their receive time and Kafka timestamp or not, ids and outputs with newlines and
    quotes (a pre-encoded Raw output's newlines are not escaped), and outputs the format cannot write (an
    object; an int past 64 bits in msgpack) among the others: each value is the one-record encoder's
    bytes, or None where that encoder raises."""
    enc = ResultEncoder("m", "2", fmt, encoding)  # type: ignore[arg-type]
    recs = [rec(i, received_at=received, produced_at_ms=produced, id=rid)
            for i, (_, received, produced, rid) in enumerate(cases)]
    outs = [c[0] for c in cases]
    values = enc.encode_ok(recs, outs, len(recs), 10.5, 0.01, 11.0, 2_000.0)
    for r, out, value in zip(recs, outs, values, strict=True):
        try:
            want: bytes | None = enc.encode(r, "ok", out, None, len(recs), 10.5 - r.received_at, 0.01, 11.0,
                                            2_000.0)
        except UNENCODABLE:
            want = None
        assert value == want
