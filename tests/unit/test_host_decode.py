"""Host work off the loop thread: a handler's ``decode_batch`` on the host pool
(``worker.device.host_pool``), in the engine's collate stage, its per-record failures as dead letters at
stage ``decode``, and the intake that leaves decoding to the device (the record carries its inputs, sized by
``estimate_size``)."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import pytest

from tests.unit.fakes_kafka import FakeModel, Harness, make_config, request
from worker.core.ports import DecodeFailed
from worker.core.records import Batch, Record, TopicPartition
from worker.device.engine import Engine
from worker.device.errors import OutputCountError
from worker.device.host_pool import MIN_CHUNK, HostPool, decode_chunk
from worker.device.pipeline import DeviceWorker
from worker.pipeline.intake import Intake


class BatchDecoding:
    """Items are ``("item", x)``; an input ``"bad"`` fails to decode (alone and in any batch), ``"poison"``
    decodes but fails in forward. ``decode_batch`` sleeps (the GIL released, as a Rust tokenizer does)."""

    name, version = "batchy", "1"
    input_type: Any = Any
    output_type: Any = Any
    uses_torch = False

    def __init__(self, sleep_s: float = 0.0) -> None:
        self.sleep_s = sleep_s
        self.threads: set[str] = set()
        self.lock = threading.Lock()

    def setup(self, device: str) -> None:
        pass

    def decode(self, x: Any) -> Any:
        if x == "bad":
            raise ValueError("cannot decode 'bad'")
        return ("item", x)

    def decode_batch(self, inputs: Sequence[Any]) -> list[Any]:
        with self.lock:
            self.threads.add(threading.current_thread().name)
        time.sleep(self.sleep_s)
        if "bad" in inputs:
            raise ValueError("a bad input in the batch")
        return [("item", x) for x in inputs]

    def estimate_size(self, x: Any) -> int:
        return len(str(x))

    def collate(self, items: Sequence[Any]) -> list[Any]:
        assert all(isinstance(it, tuple) and it[0] == "item" for it in items), items
        return list(items)

    def forward(self, batch: list[Any]) -> list[Any]:
        if any(x == ("item", "poison") for x in batch):
            raise RuntimeError("poison in the batch")
        return [x[1] for x in batch]

    def split(self, output: list[Any], n: int) -> list[Any]:
        return output


def test_chunks_cover_the_batch_one_per_thread_and_none_is_too_small() -> None:
    pool = HostPool(4)
    try:
        for n in (0, 1, MIN_CHUNK - 1, MIN_CHUNK * 2 + 3, 256, 1000):
            spans = pool.chunks(n)
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a == b for (_, a), (b, _) in zip(spans, spans[1:], strict=False))
            assert len(spans) <= 4
            assert len(spans) == 1 or min(b - a for a, b in spans) >= MIN_CHUNK
        assert len(pool.chunks(256)) == 4 and len(pool.chunks(MIN_CHUNK * 2 + 3)) == 2
    finally:
        pool.close()


def test_the_pool_decodes_chunks_at_once_in_order() -> None:
    model, pool = BatchDecoding(sleep_s=0.2), HostPool(4)
    try:
        inputs = list(range(4 * MIN_CHUNK))
        t = time.perf_counter()
        out = pool.decode(model.decode_batch, model.decode, inputs)
        took = time.perf_counter() - t
    finally:
        pool.close()
    assert out == [("item", x) for x in inputs]
    # Four chunks of 0.2 s each at the same time: well under the 0.8 s one after another.
    assert took < 0.6, took
    assert len(model.threads) == 4 and sum(n.startswith("kiw-host") for n in model.threads) == 3


def test_a_failing_batch_decode_is_decoded_one_by_one_and_only_the_bad_input_fails() -> None:
    model = BatchDecoding()
    out = decode_chunk(model.decode_batch, model.decode, ["a", "bad", "c"])
    assert out[0] == ("item", "a") and out[2] == ("item", "c")
    assert isinstance(out[1], DecodeFailed) and isinstance(out[1].cause, ValueError)
    assert str(out[1]) == "model decode failed: ValueError: cannot decode 'bad'"


class Panic(BaseException):
    """What pyo3 raises for a Rust panic: not an Exception."""


def test_a_panic_in_decode_is_the_records_failure_not_the_threads() -> None:
    def panics(inputs: Sequence[Any]) -> list[Any]:
        raise Panic("tokenizer panicked")

    def one(x: Any) -> Any:
        if x == 2:
            raise Panic("alone too")
        return x

    out = decode_chunk(panics, one, [1, 2, 3])
    assert out[0] == 1 and out[2] == 3 and isinstance(out[1], DecodeFailed)


def test_a_decode_batch_that_returns_another_count_breaks_the_contract() -> None:
    with pytest.raises(OutputCountError, match="decode_batch returned 1 items for 2 inputs"):
        decode_chunk(lambda inputs: [1], lambda x: x, [1, 2])


def engine(model: Any) -> Engine:
    e = Engine(model, "cpu", warmup=False, host_pool=HostPool(2))
    e.setup()
    return e


def test_the_engine_decodes_in_prepare_and_puts_each_failure_at_its_record() -> None:
    eng = engine(BatchDecoding())
    out = eng.run(["a", "bad", "c", "bad"])
    assert out[0] == "a" and out[2] == "c"
    assert isinstance(out[1], DecodeFailed) and isinstance(out[3], DecodeFailed)
    every = eng.run(["bad", "bad"])  # nothing left to run: no forward, no split
    assert all(isinstance(x, DecodeFailed) for x in every)


def test_recovery_bisects_raw_inputs_and_keeps_decode_failures() -> None:
    eng = engine(BatchDecoding())
    out = eng.infer(["a", "poison", "bad", "d"])
    assert out[0] == "a" and out[3] == "d"
    assert isinstance(out[1], RuntimeError) and isinstance(out[2], DecodeFailed)


def test_the_device_pipeline_hands_decode_failures_to_done() -> None:
    eng = engine(BatchDecoding())
    recs = [Record(TopicPartition("in", 0), i, b"", item=x) for i, x in enumerate(["a", "bad", "c"])]
    batches: list[Batch | None] = [Batch("default", recs, 0.0, 0.0, 1.0, "count")]
    got: list[Any] = []
    done = threading.Event()

    def take(timeout: float) -> Batch | None:
        return batches.pop() if batches else None

    def on_done(batch: Batch, results: list[Any], timings: dict[str, float]) -> None:
        got.extend(results)
        got.append(timings)
        done.set()

    w = DeviceWorker(eng, take, on_done, poll_s=0.01)
    w.start()
    try:
        assert done.wait(10)
    finally:
        assert w.stop(10)
    assert got[0] == "a" and isinstance(got[1], DecodeFailed) and got[2] == "c"
    assert got[3]["decode"] <= got[3]["collate"]


def test_intake_leaves_decoding_to_the_device_and_sizes_by_the_estimate() -> None:
    model = BatchDecoding()
    it = Intake(make_config(), model)  # type: ignore[arg-type]
    rec = Record(TopicPartition("in", 0), 0, request("r", "hello"), received_at=0.0)
    assert it.admit(rec, 0.0) is None
    assert rec.item == "hello" and rec.size == 5
    bad = Record(TopicPartition("in", 0), 1, request("b", "bad"), received_at=0.0)
    # Decoded (and refused) later, on the host threads.
    assert it.admit(bad, 0.0) is None and bad.item == "bad"


class DeferredFake(FakeModel):
    """The runner fakes' handler, decoding a batch at a time the way the engine does."""

    def decode_batch(self, inputs: Sequence[Any]) -> list[Any]:
        return [self.decode(x) for x in inputs]

    def run(self, items: list[Any]) -> list[Any]:
        decoded = decode_chunk(self.decode_batch, self.decode, items)
        good = [x for x in decoded if not isinstance(x, DecodeFailed)]
        outs = iter(super().run(good))
        return [x if isinstance(x, DecodeFailed) else next(outs) for x in decoded]


def test_a_record_that_fails_to_decode_on_the_host_threads_is_dead_lettered_at_stage_decode(
        monkeypatch: pytest.MonkeyPatch) -> None:
    h = Harness(monkeypatch, make_config(), model=DeferredFake()).start()
    h.c.assign(("in", 0))
    for i, v in enumerate([request("ok-0", 1), request("nope", "undecodable-by-model"), request("ok-2", 2)]):
        h.c.append("in", 0, v, key=f"k{i}".encode())
    h.process()
    h.commit()
    assert h.committed() == 3
    results = {r["id"]: r for r in h.p.results()}
    assert results["ok-0"]["status"] == results["ok-2"]["status"] == "ok"
    assert results["nope"]["status"] == "error"
    assert results["nope"]["error"] == "model decode failed: ValueError: the handler cannot decode this"
    dead = h.p.dead_letters()
    assert [(p.header("x-source-offset"), p.header("x-error-stage")) for p in dead] == [("1", "decode")]


def test_host_threads_is_a_positive_count_or_the_cpus_available() -> None:
    from worker.config.settings import ConfigError

    assert make_config().model.host_threads is None
    assert make_config(model={"host_threads": 3}).model.host_threads == 3
    with pytest.raises(ConfigError, match=r"\$\.model\.host_threads"):
        make_config(model={"host_threads": 0})


def test_host_threads_also_sizes_the_rust_tokenizer_pool_unless_set(monkeypatch: pytest.MonkeyPatch) -> None:
    from worker.device import engine as torch_engine

    monkeypatch.delenv(torch_engine.RAYON_ENV, raising=False)
    Engine(BatchDecoding(), "cpu", warmup=False, host_threads=3, host_pool=HostPool(1))
    assert torch_engine.os.environ[torch_engine.RAYON_ENV] == "3"
    monkeypatch.setenv(torch_engine.RAYON_ENV, "5")
    Engine(BatchDecoding(), "cpu", warmup=False, host_threads=2, host_pool=HostPool(1))
    assert torch_engine.os.environ[torch_engine.RAYON_ENV] == "5"  # the operator's
    monkeypatch.delenv(torch_engine.RAYON_ENV)
    Engine(FakeModel(), "cpu", warmup=False, host_threads=2)  # no decode_batch: no host threads at all
    assert torch_engine.RAYON_ENV not in torch_engine.os.environ
