"""A hand-written confluent-kafka loop doing the null-device ``minilm`` work: the gpu_feed scenario's Kafka
baseline (``python -m tests.bench.kafka_loop --bootstrap B --input T --output T --group G --count N``).

One thread: consume a poll batch (up to ``--batch``) -> decode the requests (msgspec) -> tokenize them with
``encode_batch`` (the Rust pool on every core) -> a forward that costs nothing (``torch.zeros(n, 384)``) ->
produce each record's result, the bytes the worker writes (a ``schemas.Result``; outputs as 384 JSON floats,
or packed ``Float32Tensor`` with ``--outputs-encoding float32``) -> commit, at most every
``--commit-interval-ms`` (the worker's ``kafka.commit_interval_ms`` default). Offsets are committed only once
every result produced before is delivered (the producer's queue is empty when the next batch's results are
ready; a second interval without that, it flushes), so it keeps the worker's at-least-once rule; the client
settings are the worker's (``kafka_clients``). What it leaves out is everything else the
worker does: priority lanes and micro-batching across poll batches, backpressure, bucketing, dead letters,
recovery, metrics.

Prints "partitions assigned" at its first assignment and one JSON line at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

import msgspec
import torch
from confluent_kafka import Consumer, Producer, TopicPartition

from schemas import Result, Source, Timings
from worker.kafka.clients import CONSUMER_DEFAULTS, CONSUMER_FIXED, PRODUCER_DEFAULTS
from worker.models.base import float32_rows
from worker.models.minilm import DIM, MiniLMModel


class _Req(msgspec.Struct):
    id: str
    inputs: dict[str, Any]


def outputs_of(out: torch.Tensor, encoding: str) -> list[Any]:
    """Each record's outputs as the worker sends them: a list of floats, or packed from the tensor's bytes."""
    if encoding == "float32":
        return list(float32_rows(out, int(out.shape[0])))
    return out.tolist()


def run(args: argparse.Namespace) -> dict[str, Any]:
    tok = MiniLMModel().tokenizer
    tok.encode_batch(["warm up the Rust thread pool"] * 64)
    dec, enc = msgspec.json.Decoder(_Req), msgspec.json.Encoder()
    c = Consumer({"bootstrap.servers": args.bootstrap, "group.id": args.group, **CONSUMER_DEFAULTS,
                  **CONSUMER_FIXED})
    p = Producer({"bootstrap.servers": args.bootstrap, **PRODUCER_DEFAULTS})
    failed: list[str] = []

    def on_delivery(err: Any, _m: Any) -> None:
        if err is not None:
            failed.append(str(err))

    def on_assign(_c: Any, parts: list[Any]) -> None:
        print("partitions assigned", len(parts), flush=True)

    c.subscribe([args.input], on_assign=on_assign)
    pending: dict[tuple[str, int], int] = {}  # next offset to commit per partition, results not yet delivered
    done = 0
    interval, last_commit = args.commit_interval_ms / 1000.0, time.monotonic()
    commits = flushes = 0
    t0 = time.perf_counter()
    while done < args.count:
        # A short wait: consume() waits its whole timeout unless a full batch is queued, and the worker's
        # loop does not wait for a full batch either.
        msgs = c.consume(args.batch, 0.005)
        good = [m for m in msgs if m.error() is None]
        if good:
            reqs = [dec.decode(m.value()) for m in good]
            encs = tok.encode_batch([r.inputs["text"] for r in reqs])
            outs = outputs_of(torch.zeros(len(encs), DIM), args.outputs_encoding)
            # Before this batch's results are produced: an empty queue means every earlier result is
            # delivered (the tokenizing above gave the previous batch's time to be sent and acknowledged).
            p.poll(0)
            since = time.monotonic() - last_commit
            if pending and since >= interval and (len(p) == 0 or since >= 2 * interval):
                if len(p):
                    p.flush(60)
                    flushes += 1
                c.commit(offsets=[TopicPartition(t, part, o) for (t, part), o in pending.items()],
                         asynchronous=True)
                commits += 1
                pending.clear()
                last_commit = time.monotonic()
            for m, r, o in zip(good, reqs, outs, strict=True):
                value = enc.encode(Result(
                    id=r.id, status="ok", outputs=o, model="minilm", model_version="all-MiniLM-L6-v2",
                    lane="default", batch_size=len(good),
                    source=Source(topic=m.topic(), partition=m.partition(), offset=m.offset()),
                    timings=Timings(queue_ms=0.0, inference_ms=0.0, total_ms=0.0, e2e_ms=0.0)))
                while True:
                    try:
                        p.produce(args.output, value, m.key(), on_delivery=on_delivery)
                        break
                    except BufferError:
                        p.poll(0.01)
                pending[(m.topic(), m.partition())] = m.offset() + 1
            done += len(good)
        else:
            p.poll(0)
        if failed:
            raise RuntimeError(f"produce failed: {failed[0]}")
    p.flush(60)
    if pending:
        c.commit(offsets=[TopicPartition(t, part, o) for (t, part), o in pending.items()], asynchronous=False)
    elapsed = time.perf_counter() - t0
    c.close()
    return {"records": done, "elapsed_s": elapsed, "commits": commits, "flushes": flushes}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bootstrap", required=True, help="Kafka bootstrap servers")
    ap.add_argument("--input", required=True,
                    help="input topic: requests as worker load --model-input minilm sends")
    ap.add_argument("--output", required=True, help="output topic for the results")
    ap.add_argument("--group", required=True, help="consumer group id")
    ap.add_argument("--count", type=int, required=True, help="exit after this many records")
    ap.add_argument("--batch", type=int, default=256, help="records per poll batch at most")
    ap.add_argument("--commit-interval-ms", type=int, default=1000,
                    help="commit at most this often, once the results produced before are delivered")
    ap.add_argument("--outputs-encoding", default="lists", choices=["lists", "float32"],
                    help="outputs as JSON floats (lists) or packed little-endian float32 bytes")
    print(json.dumps(run(ap.parse_args(argv))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
