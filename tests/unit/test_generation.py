"""The generation worker's thread against synthetic-lm, with a fake take/done (the dispatch room's side)."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import msgspec
import pytest

from worker.config.settings import GenerationConfig, ModelConfig
from worker.core.records import Batch, Record, TopicPartition
from worker.core.step_scheduler import Expired, LaneRule
from worker.models.generative import GenerationRequestError, GenerativeModel
from worker.models.inputs import GenerateInput, GenerationOutput
from worker.models.registry import load_model
from worker.pipeline.generation import GenerationError, GenerationWorker

TP0, TP1 = TopicPartition("in", 0), TopicPartition("in", 1)


def model(**options: Any) -> GenerativeModel:
    m = load_model(ModelConfig(name="synthetic-lm", options={"a_ms": 0.5, "b_ms": 0.0, **options},
                               generation=GenerationConfig(max_new_tokens=50, max_stop=1, max_sequences=3)))
    assert isinstance(m, GenerativeModel)
    return m


def rec(m: GenerativeModel, offset: int, tp: TopicPartition = TP0, deadline: float | None = None,
        **inputs: Any) -> Record:
    r = Record(tp, offset, b"", received_at=time.monotonic(), id=f"r{tp.partition}-{offset}",
               deadline=deadline)
    r.item = m.decode(msgspec.convert({"prompt": "hello", **inputs}, GenerateInput))
    return r


class Feed:
    def __init__(self) -> None:
        self.todo: queue.SimpleQueue[Batch] = queue.SimpleQueue()
        self.out: queue.SimpleQueue[tuple[Batch, list[Any]]] = queue.SimpleQueue()
        self.current: set[TopicPartition] = {TP0, TP1}
        self.max_in_flight = 0

    def add(self, *records: Record) -> None:
        now = time.monotonic()
        self.todo.put(Batch("default", list(records), now, now, "count"))

    def take(self, timeout: float, in_flight: int, only: frozenset[str] | None) -> Batch | None:
        self.max_in_flight = max(self.max_in_flight, in_flight)
        try:
            return self.todo.get(timeout=max(timeout, 0.001))
        except queue.Empty:
            return None

    def done(self, batch: Batch, outputs: list[Any], timings: dict[str, float]) -> None:
        self.out.put((batch, outputs))

    def results(self, n: int, timeout: float = 10.0) -> dict[int, Any]:
        got: dict[int, Any] = {}
        until = time.monotonic() + timeout
        while len(got) < n and time.monotonic() < until:
            try:
                batch, outs = self.out.get(timeout=0.05)
            except queue.Empty:
                continue
            for r, o in zip(batch.records, outs, strict=True):
                assert r.offset not in got, f"offset {r.offset} handed back twice"
                got[r.offset] = o
        return got


def worker(m: GenerativeModel, feed: Feed) -> GenerationWorker:
    w = GenerationWorker(m, "cpu", lanes=[LaneRule("default")], limits=m.limits, take=feed.take,
                         done=feed.done, is_current=lambda r: r.tp in feed.current, poll_s=0.01)
    w.start()
    return w


def test_request_limits_name_the_field() -> None:
    m = model()
    ok = m.decode(GenerateInput(prompt="x"))
    assert ok.params.max_new_tokens == 50  # default_max_new_tokens 64, capped at the limit
    with pytest.raises(GenerationRequestError, match=r"\$\.inputs\.max_new_tokens: 51, over model"):
        m.decode(GenerateInput(prompt="x", max_new_tokens=51))
    with pytest.raises(GenerationRequestError, match=r"\$\.inputs\.stop: 2 stop strings"):
        m.decode(GenerateInput(prompt="x", stop=["a", "b"]))
    with pytest.raises(msgspec.ValidationError, match=r"\$\.top_p"):
        msgspec.convert({"prompt": "x", "top_p": 0}, GenerateInput)


def test_every_record_comes_back_once_with_its_output_and_slots_hold() -> None:
    m, feed = model(), Feed()
    w = worker(m, feed)
    try:
        recs = [rec(m, i, max_new_tokens=1 + i % 7) for i in range(20)]
        for i in range(0, 20, 4):
            feed.add(*recs[i:i + 4])
        got = feed.results(20)
    finally:
        assert w.stop(5)
    assert sorted(got) == list(range(20)) and w.error is None
    for i, out in got.items():
        assert isinstance(out, GenerationOutput)
        assert out.generated_tokens == 1 + i % 7 and out.finish_reason == "length" and out.ttft_ms is not None
    assert max(m.step_model().steps) <= 3  # max_sequences
    # Deterministic per record: the seed comes from the record's id.
    m2, feed2 = model(), Feed()
    w2 = worker(m2, feed2)
    try:
        feed2.add(rec(m2, 5, max_new_tokens=1 + 5 % 7))
        again = feed2.results(1)
    finally:
        w2.stop(5)
    assert again[5].token_ids == got[5].token_ids


def test_poison_fails_alone_and_deadline_expires_with_partial_output() -> None:
    m, feed = model(fail_on="POISON", a_ms=2.0), Feed()
    w = worker(m, feed)
    try:
        feed.add(rec(m, 0, max_new_tokens=10), rec(m, 1, prompt="POISON", max_new_tokens=10),
                 rec(m, 2, deadline=time.monotonic() + 0.02, max_new_tokens=50))
        got = feed.results(3)
    finally:
        w.stop(5)
    assert isinstance(got[0], GenerationOutput) and got[0].generated_tokens == 10
    assert isinstance(got[1], GenerationError) and "poison" in str(got[1])
    assert isinstance(got[2], Expired) and got[2].output.finish_reason == "deadline"
    assert 0 < got[2].output.generated_tokens < 50


def test_abandon_drops_a_released_partitions_sequences_at_once() -> None:
    m, feed = model(a_ms=5.0), Feed()
    w = worker(m, feed)
    try:
        feed.add(rec(m, 0, TP0, max_new_tokens=50), rec(m, 1, TP1, max_new_tokens=3))
        time.sleep(0.05)
        dropped = w.abandon({TP0})
        got = feed.results(1)
        time.sleep(0.05)
        assert feed.out.empty()
        assert w.in_flight == 0
    finally:
        w.stop(5)
    assert [r.offset for r in dropped] == [0] and list(got) == [1]
    assert m.step_model().active == 0  # the abandoned sequence's cache was released


def test_stop_ends_the_thread() -> None:
    m, feed = model(), Feed()
    w = worker(m, feed)
    assert w.alive
    started = threading.active_count()
    assert w.stop(5) and not w.alive and threading.active_count() == started - 1
