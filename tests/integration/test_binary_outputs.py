"""``delivery.outputs_encoding: float32`` on the real broker: the tiny model's class probabilities come back
as little-endian float32 bytes with dtype and shape (base64 in JSON, a bin in msgpack), equal to the JSON
lists of a worker with the default encoding within float32 precision."""

from __future__ import annotations

import base64
import struct

import msgspec
import pytest

from tests.support.kafka_io import (
    WorkerProcess,
    create_topics,
    decode,
    produce_values,
    read_all,
    worker_config,
)

pytestmark = pytest.mark.integration

N = 400


def _features(i: int) -> list[float]:
    return [((i * 7 + j) % 13) / 6.0 - 1.0 for j in range(16)]


def _unpack(t: dict, data: bytes) -> list[float]:
    assert t["dtype"] == "float32" and len(t["shape"]) == 1
    (n,) = t["shape"]
    return list(struct.unpack(f"<{n}f", data))


def test_float32_outputs_round_trip_and_equal_the_json_lists(kafka, topic_names, tmp_path):
    bs, run = kafka.bootstrap, topic_names["run"]
    in_json, in_msgpack = topic_names["in"], f"t-in-mp-{run}"
    outs = {"lists": f"t-out-lists-{run}", "json": f"t-out-f32j-{run}", "msgpack": f"t-out-f32m-{run}"}
    create_topics(bs, {in_json: 2, in_msgpack: 2, topic_names["dlq"]: 1, **{o: 2 for o in outs.values()}})
    bodies = [{"id": f"b-{i}", "inputs": _features(i)} for i in range(N)]
    produce_values(bs, in_json, [(b["id"].encode(), msgspec.json.encode(b)) for b in bodies])
    produce_values(bs, in_msgpack, [(b["id"].encode(), msgspec.msgpack.encode(b)) for b in bodies])

    def cfg(name: str, topic: str, **delivery: str) -> dict:
        names = {**topic_names, "in": topic, "out": outs[name]}
        return worker_config(bs, names, group=f"g-{name}-{run}", delivery=delivery)

    workers = [
        WorkerProcess(cfg("lists", in_json), tmp_path, name="lists").start(),
        WorkerProcess(cfg("json", in_json, outputs_encoding="float32"), tmp_path, name="f32-json").start(),
        WorkerProcess(cfg("msgpack", in_msgpack, format="msgpack", outputs_encoding="float32"), tmp_path,
                      name="f32-msgpack").start(),
    ]
    try:
        got = {name: read_all(bs, topic, want=N, timeout=180) for name, topic in outs.items()}
        for w in workers:
            assert w.stop() == 0, w.log()[-3000:]
    finally:
        for w in workers:
            w.kill()

    lists = {r["id"]: r for r in decode(got["lists"])}
    f32_json = {r["id"]: r for r in decode(got["json"])}
    f32_msgpack = {r["id"]: r for r in (msgspec.msgpack.decode(m.value()) for m in got["msgpack"])}
    assert set(lists) == set(f32_json) == set(f32_msgpack) == {b["id"] for b in bodies}
    for rid, ref in lists.items():
        assert ref["status"] == "ok" and isinstance(ref["outputs"], list) and len(ref["outputs"]) == 4
        tj, tm = f32_json[rid]["outputs"], f32_msgpack[rid]["outputs"]
        assert tj["shape"] == tm["shape"] == [4]
        assert isinstance(tm["data"], bytes) and len(tm["data"]) == 16  # msgpack: a bin, as is
        from_json = _unpack(tj, base64.b64decode(tj["data"]))  # JSON: base64
        from_msgpack = _unpack(tm, tm["data"])
        # The same model on the same inputs (in batches that may differ: a kernel may round differently by
        # an ulp): within float32 precision of the JSON lists.
        for got_values in (from_json, from_msgpack):
            assert all(abs(a - b) <= 1e-6 * max(1.0, abs(b))
                       for a, b in zip(got_values, ref["outputs"], strict=True)), (rid, got_values, ref)
        # Everything but the outputs says the same.
        for r in (f32_json[rid], f32_msgpack[rid]):
            assert (r["status"], r["model"], r["model_version"], r["batch_size"] > 0) == (
                "ok", ref["model"], ref["model_version"], True)
