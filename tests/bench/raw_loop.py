"""Baseline: the plain confluent-kafka loop a competent engineer writes for the same job, no framework.

consume(1000) -> decode the JSON request (msgspec) -> encode a result (id, status, outputs = inputs, model,
source) -> produce it with the request's key -> every ``commit_interval_ms``: flush the producer (every
result delivered) and commit the consumed positions synchronously. Same librdkafka settings as the worker
(``worker.kafka.clients`` defaults: idempotent producer, acks=all, linger 5 ms, lz4; no auto
commit). At-least-once like the worker, without its per-record tracking, lanes or batching.

``python -m tests.bench.raw_loop --bootstrap B --input T --output T --group G``; SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import signal
import time
from typing import Any

import msgspec
from confluent_kafka import Consumer, Producer
from confluent_kafka import TopicPartition as KTP

from worker.kafka.clients import CONSUMER_DEFAULTS, CONSUMER_FIXED, PRODUCER_DEFAULTS


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--commit-interval-ms", type=float, default=1000.0)
    args = ap.parse_args()

    running = True

    def stop(*_: Any) -> None:
        nonlocal running
        running = False

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    consumer = Consumer({"bootstrap.servers": args.bootstrap, "group.id": args.group,
                         **CONSUMER_DEFAULTS, **CONSUMER_FIXED})
    producer = Producer({"bootstrap.servers": args.bootstrap, **PRODUCER_DEFAULTS})
    dec = msgspec.json.Decoder()
    enc = msgspec.json.Encoder()
    out_topic = args.output
    positions: dict[tuple[str, int], int] = {}
    interval = args.commit_interval_ms / 1000.0
    last_commit = time.monotonic()

    def commit() -> None:
        if not positions:
            return
        producer.flush(30)  # every result produced so far is delivered before its offset is committed
        consumer.commit(offsets=[KTP(t, p, o) for (t, p), o in positions.items()], asynchronous=False)

    consumer.subscribe([args.input])
    print("raw loop started", flush=True)
    while running:
        msgs = consumer.consume(1000, 0.1)
        for m in msgs:
            if m.error() is not None:
                continue
            topic, part, off = m.topic(), m.partition(), m.offset()
            req = dec.decode(m.value())
            value = enc.encode({"id": req["id"], "status": "ok", "outputs": req.get("inputs"),
                                "model": "identity",
                                "source": {"topic": topic, "partition": part, "offset": off}})
            while True:
                try:
                    producer.produce(out_topic, value=value, key=m.key())
                    break
                except BufferError:
                    producer.poll(0.05)
            positions[(topic, part)] = off + 1
        producer.poll(0)
        if time.monotonic() - last_commit >= interval:
            commit()
            last_commit = time.monotonic()
    commit()
    consumer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
