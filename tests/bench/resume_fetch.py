"""How long a resumed partition waits for its first record, with and without the worker's wake-up.

A bare confluent-kafka consumer with the worker's consumer settings reads a backlog of 60,000 records from 4
partitions; every 12,000 records it pauses all of them for 50 ms and resumes them, as the worker's
backpressure does. librdkafka does not wake the broker thread on resume, so the first fetch waits for that
thread's next wake-up. ``seek`` to each partition's own position (``Runner._wake_fetcher``) wakes it.

``PYTHONPATH=. python -m tests.bench.resume_fetch`` prints, per variant, the records/s and the seconds from
each resume to the first record, and the ratio of the two mean waits.
"""

from __future__ import annotations

import statistics
import time

from confluent_kafka import Consumer
from confluent_kafka import TopicPartition as KTP

from tests.bench.common import Broker, create_topics, produce_backlog, uid
from tests.bench.pipeline import requests
from worker.kafka.clients import CONSUMER_DEFAULTS, CONSUMER_FIXED

RECORDS, PARTITIONS, EVERY = 60_000, 4, 12_000


def run(bootstrap: str, wake: bool) -> tuple[float, list[float]]:
    """(records/s, seconds from each resume to the next record)."""
    r = uid()
    topic = f"resume-{r}"
    create_topics(bootstrap, {topic: PARTITIONS})
    produce_backlog(bootstrap, topic, requests(RECORDS), PARTITIONS)
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"resume-{r}", **CONSUMER_DEFAULTS,
                  **CONSUMER_FIXED})
    c.subscribe([topic])
    n = since = 0
    t0: float | None = None
    resumed_at: float | None = None
    waits: list[float] = []
    try:
        while n < RECORDS and (t0 is None or time.monotonic() - t0 < 60):
            m = c.poll(0.02)
            if m is None:
                continue
            now = time.monotonic()
            t0 = t0 or now
            if resumed_at is not None:
                waits.append(now - resumed_at)
                resumed_at = None
            got = [x for x in [m, *c.consume(499, 0)] if x.error() is None]
            n += len(got)
            since += len(got)
            if since >= EVERY and n < RECORDS:
                parts = c.assignment()
                c.pause(parts)
                time.sleep(0.05)
                c.resume(parts)
                resumed_at, since = time.monotonic(), 0
                if wake:
                    for k in c.position(parts):
                        if k.offset >= 0:
                            c.seek(KTP(k.topic, k.partition, k.offset))
        assert t0 is not None and n == RECORDS, f"read {n} of {RECORDS}"
        return n / (time.monotonic() - t0), waits
    finally:
        c.close()


def main() -> int:
    with Broker() as b:
        res = {wake: run(b.bootstrap, wake) for wake in (False, True)}
    for wake, (rate, waits) in res.items():
        label = "seek to own position" if wake else "resume only"
        print(f"{label:22} {rate:10,.0f} records/s   first record after resume: "
              + ", ".join(f"{w * 1000:.0f}" for w in waits) + " ms")
    ratio = statistics.mean(res[False][1]) / max(statistics.mean(res[True][1]), 1e-6)
    print(f"mean wait without / with the wake-up: {ratio:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
