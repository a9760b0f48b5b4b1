"""``worker dlq replay`` commits a batch of dead letters only once every replayed record is delivered."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError

import worker.dlq
from schemas import DeadLetter
from tests.unit.fakes_kafka import FakeMessage, make_config


class _Meta:
    def __init__(self, partitions: list[int]) -> None:
        self.partitions = {p: None for p in partitions}
        self.error = None


class ReplayConsumer:
    """Two dead letters on dlq[0], then end of partition."""

    def __init__(self) -> None:
        dl = DeadLetter(error="boom", error_stage="inference", source_topic="in", source_partition=0,
                        source_offset=7, attempts=1)
        self.batches = [[FakeMessage("dlq", 0, 0, b"v0", b"k", dl.headers()),
                         FakeMessage("dlq", 0, 1, b"v1", b"k", dl.headers())],
                        [FakeMessage.failure(KafkaError(KafkaError._PARTITION_EOF), "dlq", 0, 2)]]
        self.commits: list[Any] = []

    def list_topics(self, topic: str, timeout: float = -1) -> Any:
        return type("Md", (), {"topics": {topic: _Meta([0])}})()

    def get_watermark_offsets(self, tp: Any, timeout: float = -1) -> tuple[int, int]:
        return 0, 2

    def assign(self, tps: list[Any]) -> None:
        pass

    def consume(self, n: int, timeout: float) -> list[FakeMessage]:
        return self.batches.pop(0) if self.batches else []

    def commit(self, offsets: Any = None, asynchronous: bool = True) -> None:
        self.commits.append(offsets)

    def close(self) -> None:
        pass


class StuckProducer:
    """The broker takes nothing: flush() times out with every message still outstanding."""

    def __init__(self, conf: dict[str, Any]) -> None:
        self.produced: list[Any] = []
        self.flushes: list[float] = []
        self.purged = False

    def produce(self, topic: str, **kw: Any) -> None:
        self.produced.append((topic, kw["value"]))

    def flush(self, timeout: float = -1) -> int:
        self.flushes.append(timeout)
        return 0 if self.purged else len(self.produced)

    def purge(self) -> None:
        self.purged = True


def test_nothing_is_committed_while_replayed_records_are_undelivered(monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    consumer = ReplayConsumer()
    producers: list[StuckProducer] = []
    monkeypatch.setattr(worker.dlq, "make_consumer", lambda cfg, **kw: consumer)
    monkeypatch.setattr(worker.dlq, "Producer", lambda conf: producers.append(StuckProducer(conf)) or producers[-1])
    assert worker.dlq.replay(make_config()) == 1
    assert [v for _, v in producers[0].produced] == [b"v0", b"v1"] and consumer.commits == []
    assert "still undelivered" in capsys.readouterr().out
    # One wait for delivery, then the exit: no second minute-long flush of what will be replayed anyway.
    assert producers[0].purged and producers[0].flushes[0] == 60 and sum(producers[0].flushes[1:]) <= 1
