"""Baseline: a Sentry Arroyo application doing the same job: consume -> batch -> build results -> produce
-> commit.

The idiomatic Arroyo 2 strategy chain, one ``StreamProcessor`` on the input topic: ``BatchStep`` (up to
``--batch-size`` records or ``--batch-time-ms``, the worker's lane limits) -> ``RunTask`` (one call per
batch: the result of every request in it) -> ``UnbatchStep`` -> ``Produce`` (a future per result, passed on
in order once its delivery report is in) -> ``CommitOffsets`` (stages the offset after each delivered
result; the processor commits the staged offsets once a second, the worker's ``commit_interval_ms``
default). At-least-once like the worker: an offset is committed only after the results before it were
delivered.

librdkafka gets the worker's fetch and produce settings (``worker.kafka.clients`` defaults:
prefetch queue, fetch wait and backoff; idempotence, acks=all, linger, batch size, lz4), so that the
comparison is of the frameworks, not of their defaults. Arroyo keeps what it requires: per-message delivery
reports (its ``Produce`` step waits on one future per message; the producer makes them Arroyo's light
``SimpleProducerFuture``, which has no condition variable), its strict offset reset, statistics callback and
the range assignor. Per record it builds the same result as the raw loop (id, status, outputs, model,
source).

``python -m tests.bench.arroyo_app --bootstrap B --input T --output T --group G``; SIGTERM stops it (the
processor closes its strategy and commits the offsets of the results delivered by then; the producer then
delivers what is still in flight, whose records a restart reads again).
"""

from __future__ import annotations

import argparse
import logging
import signal
from collections.abc import Mapping, MutableSequence
from typing import Any

import msgspec
from arroyo.backends.kafka import (
    KafkaConsumer,
    KafkaPayload,
    KafkaProducer,
    build_kafka_configuration,
    build_kafka_consumer_configuration,
)
from arroyo.commit import ONCE_PER_SECOND
from arroyo.processing import StreamProcessor
from arroyo.processing.strategies import (
    BatchStep,
    CommitOffsets,
    ProcessingStrategy,
    ProcessingStrategyFactory,
    Produce,
    RunTask,
    UnbatchStep,
)
from arroyo.types import BaseValue, BrokerValue, Commit, FilteredPayload, Message, Partition, Topic

from worker.kafka.clients import CONSUMER_DEFAULTS, PRODUCER_DEFAULTS

Batch = MutableSequence[BaseValue[KafkaPayload]]
# What UnbatchStep hands on to Produce, whose input may also be a filtered (skipped) message.
Results = MutableSequence[BaseValue[KafkaPayload | FilteredPayload]]
_dec = msgspec.json.Decoder()
_enc = msgspec.json.Encoder()


def results(message: Message[Batch]) -> Results:
    """The result of every request in the batch, each keeping its request's key and committable offset."""
    out: Results = []
    for v in message.payload:
        assert isinstance(v, BrokerValue)  # BatchStep keeps the consumer's values: partition and offset
        req = v.payload
        body = _dec.decode(req.value)
        source = {"topic": v.partition.topic.name, "partition": v.partition.index, "offset": v.offset}
        value = _enc.encode({"id": body["id"], "status": "ok", "outputs": body.get("inputs"),
                             "model": "identity", "source": source})
        out.append(v.replace(KafkaPayload(req.key, value, [])))
    return out


class Strategy(ProcessingStrategyFactory[KafkaPayload]):
    """A fresh chain per assignment, as Arroyo's processor asks; the producer is shared and outlives it."""

    def __init__(self, producer: KafkaProducer, output: str, batch_size: int, batch_time_s: float) -> None:
        self.producer = producer
        self.output = Topic(output)
        self.batch_size = batch_size
        self.batch_time_s = batch_time_s

    def create_with_partitions(self, commit: Commit,
                               partitions: Mapping[Partition, int]) -> ProcessingStrategy[KafkaPayload]:
        produce: Produce[KafkaPayload] = Produce(self.producer, self.output, CommitOffsets(commit))
        return BatchStep(self.batch_size, self.batch_time_s, RunTask(results, UnbatchStep(produce)))


def consumer_config(bootstrap: str, group: str) -> dict[str, Any]:
    fetch = {k: CONSUMER_DEFAULTS[k] for k in ("fetch.wait.max.ms", "fetch.queue.backoff.ms")}
    return build_kafka_consumer_configuration(
        {}, group_id=group, auto_offset_reset="earliest", bootstrap_servers=[bootstrap],
        queued_max_messages_kbytes=CONSUMER_DEFAULTS["queued.max.messages.kbytes"],
        queued_min_messages=CONSUMER_DEFAULTS["queued.min.messages"], override_params=fetch)


def producer_config(bootstrap: str) -> dict[str, Any]:
    # No "delivery.report.only.error": Produce resolves each message's future from its delivery report.
    extra = {k: PRODUCER_DEFAULTS[k] for k in ("enable.idempotence", "acks", "linger.ms",
                                               "batch.num.messages", "compression.type")}
    return build_kafka_configuration({}, bootstrap_servers=[bootstrap], override_params=extra)


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.arroyo_app", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--batch-size", type=int, default=256, help="BatchStep's max_batch_size (records)")
    ap.add_argument("--batch-time-ms", type=float, default=5.0, help="BatchStep's max_batch_time")
    args = ap.parse_args()
    logging.basicConfig(level=logging.WARNING)

    producer = KafkaProducer(producer_config(args.bootstrap), use_simple_futures=True)
    processor = StreamProcessor(KafkaConsumer(consumer_config(args.bootstrap, args.group)), Topic(args.input),
                                Strategy(producer, args.output, args.batch_size, args.batch_time_ms / 1000.0),
                                commit_policy=ONCE_PER_SECOND)

    def stop(*_: Any) -> None:
        processor.signal_shutdown()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print("arroyo app started", flush=True)
    try:
        processor.run()
    finally:
        producer.close().result(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
