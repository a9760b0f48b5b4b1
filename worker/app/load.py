"""``worker load``: synthetic requests at a given rate (also used by the demo, tests and benchmarks)."""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import msgspec
from confluent_kafka import KafkaException, Producer

_enc = msgspec.json.Encoder()
CONNECT_TIMEOUT_S = 10.0  # a broker that does not answer this soon is reported, not waited on
FLUSH_TIMEOUT_S = 60.0  # what is still undelivered this long after the last produce() is an error

SENTENCES = [
    "Kafka keeps the log; the worker keeps the promise.",
    "A short one.",
    "Batching requests by count or by time trades a little latency for a lot of throughput on accelerators.",
    "The quick brown fox jumps over the lazy dog.",
    "Priority lanes let urgent traffic overtake the backlog without starving it.",
    "Offsets are committed only after the results are safely delivered to the output topic, never before.",
    "GPU time is expensive.",
    "Embeddings map sentences to vectors so that similar meanings end up close together in space.",
]


def make_inputs(kind: str, rng: random.Random) -> Callable[[int], Any]:
    if kind == "tiny":
        return lambda i: [round(rng.uniform(-1, 1), 4) for _ in range(16)]
    if kind == "synthetic":
        return lambda i: {"x": i}
    if kind == "identity":
        return lambda i: {"v": i}
    if kind == "minilm":
        return lambda i: {"text": SENTENCES[i % len(SENTENCES)] + f" #{i}"}
    raise ValueError(f"unknown --model-input {kind!r}: expected tiny, synthetic, identity or minilm")


def parse_lanes(spec: str | None) -> list[tuple[str, float]]:
    if not spec:
        return []
    out = []
    for part in spec.split(","):
        name, _, share = part.partition("=")
        name = name.strip()
        if not name:
            # (a trailing comma used to add a lane named "" that took a share of the traffic)
            raise ValueError(f"--lanes: a lane without a name in {spec!r}; expected NAME=FRACTION, e.g. "
                             "high=0.1,low=0.9")
        try:
            value = float(share) if share else 1.0
        except ValueError:
            raise ValueError(
                f"--lanes: bad share in {part!r}; expected NAME=FRACTION, e.g. high=0.1,low=0.9"
            ) from None
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"--lanes: share of {name!r} must be a finite number >= 0, got {share!r}")
        out.append((name, value))
    if not any(w > 0 for _, w in out):
        raise ValueError(f"--lanes: every share in {spec!r} is 0; at least one lane needs a share > 0")
    return out


def requests(count: int, kind: str = "tiny", lanes: str | None = None, id_prefix: str = "req",
             deadline_ms: int | None = None, seed: int = 7) -> Iterator[tuple[bytes, bytes]]:
    """(key, value) pairs of valid requests."""
    rng = random.Random(seed)
    inputs = make_inputs(kind, rng)
    mix = parse_lanes(lanes)
    names = [n for n, _ in mix]
    weights = [w for _, w in mix]
    for i in range(count):
        req: dict[str, Any] = {"id": f"{id_prefix}-{i}", "inputs": inputs(i)}
        if mix:
            req["priority"] = rng.choices(names, weights)[0]
        if deadline_ms is not None:
            req["deadline_ms"] = int(time.time() * 1000) + deadline_ms
        yield req["id"].encode(), _enc.encode(req)


def load_producer(bootstrap: str, producer_conf: dict[str, Any] | None = None) -> Producer:
    from worker.kafka.clients import client_log

    return Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "enable.idempotence": True,
                     "queue.buffering.max.messages": 1_000_000, "logger": client_log("load"),
                     **(producer_conf or {})})


def produce(bootstrap: str, topic: str, items: Iterator[tuple[bytes, bytes]], rate: float = 0.0,
            producer_conf: dict[str, Any] | None = None, producer: Producer | None = None) -> int:
    """Produce at ``rate`` records/s (0 = unthrottled); returns the count delivered. Raises on failures.
    ``producer``: one from ``load_producer`` to reuse (its first flush waits for the idempotent producer id,
    ~0.5 s on a fresh broker, which a paced run should not count)."""
    p = producer if producer is not None else load_producer(bootstrap, producer_conf)
    try:
        p.list_topics(timeout=CONNECT_TIMEOUT_S)
    except KafkaException as e:
        raise RuntimeError(f"cannot reach Kafka at {bootstrap} within {CONNECT_TIMEOUT_S:.0f} s: "
                           f"{e.args[0].str() if e.args else e}") from None
    failed: list[str] = []
    delivered = 0

    def cb(err: Any, _msg: Any) -> None:
        nonlocal delivered
        if err is not None:
            failed.append(str(err))
        else:
            delivered += 1

    start = time.monotonic()
    it = iter(items)
    n = 0
    while True:
        # Paced before the next request is made, not after: a deadline it carries counts from its send (made
        # first, a request waited up to 1/rate before it was sent, and at low rates was past its deadline).
        if rate > 0:
            ahead = start + n / rate - time.monotonic()
            if ahead > 0:
                time.sleep(ahead)
        try:
            key, value = next(it)
        except StopIteration:
            break
        n += 1
        while True:
            try:
                p.produce(topic, value=value, key=key, on_delivery=cb)
                break
            except BufferError:
                p.poll(0.05)
        p.poll(0)
    undelivered = p.flush(FLUSH_TIMEOUT_S)
    if failed:
        raise RuntimeError(f"{len(failed)} records failed to deliver, first: {failed[0]}")
    if undelivered:
        raise RuntimeError(f"{undelivered} records still undelivered {FLUSH_TIMEOUT_S:.0f} s after the last "
                           f"was produced ({delivered} delivered)")
    return delivered


def load_main(args: argparse.Namespace) -> int:
    bootstrap = args.bootstrap or os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "127.0.0.1:9092")
    try:
        parse_lanes(args.lanes)
    except ValueError as e:
        print(f"usage error: {e}", file=sys.stderr)
        return 2
    if args.count < 0 or args.rate < 0:
        print("usage error: --count and --rate must be >= 0", file=sys.stderr)
        return 2
    if args.deadline_ms is not None and not -(2**53) <= int(time.time() * 1000) + args.deadline_ms <= 2**53:
        # The request schema's deadline_ms is an integer within +-2^53: every record would be dead-lettered.
        print(f"usage error: --deadline-ms {args.deadline_ms} puts deadlines outside +-2^53 ms",
              file=sys.stderr)
        return 2
    t0 = time.monotonic()
    try:
        n = produce(bootstrap, args.topic, requests(args.count, args.model_input, args.lanes, args.id_prefix,
                                                    args.deadline_ms), rate=args.rate)
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    dt = time.monotonic() - t0
    print(f"produced {n} records to {args.topic} in {dt:.1f}s ({n / dt if dt else 0:.0f}/s)")
    return 0
