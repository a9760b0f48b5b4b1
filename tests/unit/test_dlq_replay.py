"""``worker dlq replay`` commits a batch of dead letters only once every replayed record is delivered."""

from __future__ import annotations

from typing import Any

import pytest
from confluent_kafka import KafkaError

import worker.app.dlq
from schemas import DeadLetter
from tests.unit.fakes_kafka import FakeMessage, FakeTime, make_config
from worker.kafka.clients import consumer_config


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


def test_nothing_is_committed_while_replayed_records_are_undelivered(
        capsys: pytest.CaptureFixture[str]) -> None:
    consumer = ReplayConsumer()
    producers: list[StuckProducer] = []
    def new_producer(conf: dict[str, Any]) -> StuckProducer:
        producers.append(StuckProducer(conf))
        return producers[-1]

    assert worker.app.dlq.replay(make_config(), new_consumer=lambda cfg, **kw: consumer,
                             new_producer=new_producer) == 1
    assert [v for _, v in producers[0].produced] == [b"v0", b"v1"] and consumer.commits == []
    assert "still undelivered" in capsys.readouterr().out
    # One wait for delivery, then the exit: no second minute-long flush of what will be replayed anyway.
    assert producers[0].purged and producers[0].flushes[0] == 60 and sum(producers[0].flushes[1:]) <= 1


class OkProducer(StuckProducer):
    def flush(self, timeout: float = -1) -> int:
        self.flushes.append(timeout)
        return 0


def test_a_stage_filter_replays_in_a_group_of_its_own() -> None:
    """A filtered run commits past the dead letters of other stages; in the shared replay group a later run
    for those stages would never see them."""
    groups: list[str] = []
    runs = {"inference": ReplayConsumer(), None: ReplayConsumer()}
    producers: list[OkProducer] = []

    def consumer_for(stage: str | None) -> Any:
        def make(cfg: Any, **kw: Any) -> Any:
            groups.append(kw["group.id"])
            return runs[stage]
        return make

    def new_producer(conf: dict[str, Any]) -> OkProducer:
        producers.append(OkProducer(conf))
        return producers[-1]

    cfg = make_config(kafka={"group_id": "g"})
    assert worker.app.dlq.replay(cfg, stage="inference", new_consumer=consumer_for("inference"),
                             new_producer=new_producer) == 0
    assert worker.app.dlq.replay(cfg, new_consumer=consumer_for(None), new_producer=new_producer) == 0
    assert groups == ["g-dlq-replay-inference", "g-dlq-replay"]
    assert [len(p.produced) for p in producers] == [2, 2]  # the unfiltered run sees both again


class SilentConsumer(ReplayConsumer):
    """The broker or the partition leader is gone: reads return nothing, or only errors."""

    def consume(self, n: int, timeout: float) -> list[FakeMessage]:
        return [FakeMessage.failure(KafkaError(KafkaError._TRANSPORT), "dlq", 0, 0)]


def test_no_progress_with_dead_letters_left_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    assert worker.app.dlq.replay(make_config(), timeout_s=0.05,
                                 new_consumer=lambda cfg, **kw: SilentConsumer(),
                                 new_producer=OkProducer) == 1
    out = capsys.readouterr().out
    assert (
        "nothing read for" in out and "dead letters left on partitions [0]" in out and "consume error" in out
    )


@pytest.mark.parametrize("dry_run", [False, True])
def test_dead_letters_without_their_original_bytes_are_skipped_and_listed(
        capsys: pytest.CaptureFixture[str], dry_run: bool) -> None:
    """The worker writes an empty value where it dropped a request too big for its producer; a tombstone has
    none. Replayed, each could only fail decoding again and come back as a new dead letter."""
    def dead(offset: int, value: bytes | None, error: str = "boom", stage: str = "decode") -> FakeMessage:
        dl = DeadLetter(error=error, error_stage=stage, source_topic="in",  # type: ignore[arg-type]
                        source_partition=0, source_offset=offset, attempts=1)
        return FakeMessage("dlq", 0, offset, value, b"k", dl.headers())

    consumer = ReplayConsumer()
    consumer.batches = [[dead(0, b"v0", stage="inference"),
                         dead(1, b"", "original value of 3000 bytes dropped (over message.max.bytes=1500): "
                                      "3000 bytes is over delivery.max_input_bytes=1000", "size"),
                         dead(2, None, "not a request: no value"),
                         dead(3, b"", "not a request: empty value")],
                        [FakeMessage.failure(KafkaError(KafkaError._PARTITION_EOF), "dlq", 0, 4)]]
    consumer.get_watermark_offsets = lambda tp, timeout=-1: (0, 4)  # type: ignore[method-assign]
    producers: list[OkProducer] = []
    def new_producer(conf: dict[str, Any]) -> OkProducer:
        producers.append(OkProducer(conf))
        return producers[-1]

    assert worker.app.dlq.replay(make_config(), dry_run=dry_run, new_consumer=lambda cfg, **kw: consumer,
                             new_producer=new_producer) == 0
    out = capsys.readouterr().out
    assert [v for _, v in producers[0].produced] == ([] if dry_run else [b"v0"])
    assert ("skip dlq[0]@1 (from in[0]@1): nothing to replay: original value of 3000 bytes dropped (over "
            "message.max.bytes=1500)\n") in out
    assert "skip dlq[0]@2 (from in[0]@2): nothing to replay: no value (the request was a tombstone)" in out
    assert "skip dlq[0]@3 (from in[0]@3): nothing to replay: empty value" in out
    verb = "would replay" if dry_run else "replayed"
    assert f"dlq replay: {verb} 1 dead letters, skipped 3 (3 without the original request bytes" in out
    if not dry_run:
        assert [(o.partition, o.offset) for o in consumer.commits[-1]] == [(0, 4)]  # not to be seen again


def test_a_first_replay_starts_at_the_earliest_dead_letter_whatever_auto_offset_reset_says() -> None:
    """The replay consumer took the config's auto.offset.reset: with "latest", a first run (or a new
    --filter-stage group) started at the end, replayed nothing, committed nothing and exited 0, every time."""
    seen: dict[str, Any] = {}

    def make(cfg: Any, **extra: Any) -> ReplayConsumer:
        seen.update(consumer_config(cfg, **extra))
        return ReplayConsumer()

    cfg = make_config(kafka={"consumer": {"auto.offset.reset": "latest"}})
    assert worker.app.dlq.replay(cfg, new_consumer=make, new_producer=OkProducer) == 0
    assert seen["auto.offset.reset"] == "earliest"


def test_a_slow_delivery_that_succeeds_is_progress(capsys: pytest.CaptureFixture[str]) -> None:
    """The idle timer ran through a flush that took 35 s and succeeded: everything was delivered and
    committed, and the replay still exited 1 with "nothing read for 30 s with dead letters left on partitions
    []"."""
    clock = FakeTime(1000.0)

    class SlowFlush(OkProducer):
        def flush(self, timeout: float = -1) -> int:
            if self.produced:
                clock.advance(35.0)  # acknowledged after 35 s (60 s are allowed)
            return super().flush(timeout)

    consumer = ReplayConsumer()
    assert worker.app.dlq.replay(make_config(), new_consumer=lambda cfg, **kw: consumer,
                                 new_producer=SlowFlush, clock=clock) == 0
    assert [(o.partition, o.offset) for o in consumer.commits[-1]] == [(0, 2)]
    assert "replayed 2 dead letters" in capsys.readouterr().out
