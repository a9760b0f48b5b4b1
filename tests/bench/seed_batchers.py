"""The batchers of the two seed articles (``shared/seeds/``), re-implemented as written, fed from Kafka.

What is re-implemented, and from where
--------------------------------------
``DynamicBatcher`` - seed 000, section 3.1 "自适应批处理调度算法" (adaptive batch scheduling). As written:
a plain list ``buffer``; ``add_request`` appends and, once ``len(buffer) >= max_batch``, returns
``_process_batch()``, which stacks the buffer (``torch.stack`` -> the model handler's ``collate``) and clears
it; otherwise returns None. The constructor stores ``timeout_ms`` but the article's code never uses it.
The caller runs the model on the returned batch, synchronously.

``BatchInferenceServer`` - seed 003, section "动态批处理：让系统“聪明地”聚合请求" (dynamic batching). As
written: a ``queue.Queue`` of ``{'input', 'callback'}`` dicts and a ``ThreadPoolExecutor(max_workers=1)``;
``submit_request`` puts the request and submits one ``_process_batch`` task per request;
``_process_batch`` blocks up to ``timeout_ms`` for a first request, then takes more with ``get_nowait``
while ``qsize() > 0`` and fewer than ``max_batch_size`` are taken (it never waits to fill a batch), stacks
the inputs (``torch.stack(...).cuda()`` -> ``collate``), runs the model (``model(inputs).cpu()`` ->
``forward`` + ``split``) and calls each request's callback with its output. ``model.eval().cuda()`` is the
handler's ``setup(device)``.

The Kafka glue around them (not in the articles; the same for both, and as lean as the raw baseline)
-------------------------------------------------------------------------------------------------------
consume(1000) -> decode the JSON request (msgspec) -> the model handler's ``decode`` -> the seed's API.
A result (id, status, outputs, model, batch_size, source, timings.e2e_ms) is produced per record, with
the request's key; every ``commit_interval_ms`` the producer is flushed and the offsets of records whose
results were produced are committed (each seed completes records in arrival order, so the highest done
offset per partition is a safe commit point). Seed 000: the loop itself runs the model when
``add_request`` returns a batch; because the article's class never uses its timeout, the glue flushes a
partial buffer when a ``consume`` of ``timeout_ms`` returns nothing (without it the tail of a stream would
never be processed). Seed 003: the callback (executor thread) produces the result (confluent-kafka's
producer is thread-safe); the loop only consumes, submits, polls and commits. No backpressure: the
article's queue is unbounded, so the loop reads as fast as Kafka delivers.

``python -m tests.bench.seed_batchers --seed 000|003 --bootstrap B --input T --output T --group G
--max-batch 32 --timeout-ms 10 --a-ms 20 --b-ms 1 [--host-ms 0]``; SIGTERM stops it.
"""

from __future__ import annotations

import argparse
import queue
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import msgspec
from confluent_kafka import Consumer, Producer
from confluent_kafka import TopicPartition as KTP

from worker.kafka.clients import CONSUMER_DEFAULTS, CONSUMER_FIXED, PRODUCER_DEFAULTS
from worker.models.synthetic import SyntheticModel

# --------------------------------------------------------------------------- seed 000, section 3.1


class DynamicBatcher:
    def __init__(self, collate: Any, max_batch_size: int = 32, timeout_ms: float = 50) -> None:
        self.collate = collate  # stands in for torch.stack: the batch the model takes
        self.buffer: list[Any] = []
        self.max_batch = max_batch_size
        self.timeout = timeout_ms / 1000  # stored, never used (as in the article)

    def add_request(self, input_tensor: Any) -> Any:
        self.buffer.append(input_tensor)
        if len(self.buffer) >= self.max_batch:
            return self._process_batch()
        return None

    def _process_batch(self) -> Any:
        batch = self.collate(list(self.buffer))  # torch.stack(self.buffer) copies, then the buffer is cleared
        self.buffer.clear()
        return batch


# --------------------------------------------------------------------------- seed 003, dynamic batching


class BatchInferenceServer:
    def __init__(self, model: Any, max_batch_size: int = 16, timeout_ms: float = 10) -> None:
        model.setup("cpu")  # model.eval().cuda()
        self.model = model
        self.max_batch_size = max_batch_size
        self.timeout_ms = timeout_ms / 1000
        self.request_queue: queue.Queue[dict[str, Any]] = queue.Queue()
        self.executor = ThreadPoolExecutor(max_workers=1)

    def _process_batch(self) -> None:  # @torch.no_grad()
        requests = []
        try:
            # 尝试收集一批请求 (try to collect a batch of requests)
            req = self.request_queue.get(timeout=self.timeout_ms)
            requests.append(req)
            while len(requests) < self.max_batch_size and self.request_queue.qsize() > 0:
                req = self.request_queue.get_nowait()
                requests.append(req)
        except queue.Empty:
            pass
        if not requests:
            return
        inputs = self.model.collate([r["input"] for r in requests])  # torch.stack([...]).cuda()
        outputs = self.model.split(self.model.forward(inputs), len(requests))  # self.model(inputs).cpu()
        for i, r in enumerate(requests):
            r["callback"](outputs[i])

    def submit_request(self, input_tensor: Any, callback: Any) -> None:
        self.request_queue.put({"input": input_tensor, "callback": callback})
        self.executor.submit(self._process_batch)


# --------------------------------------------------------------------------- Kafka glue


class Glue:
    def __init__(self, args: argparse.Namespace) -> None:
        self.consumer = Consumer({"bootstrap.servers": args.bootstrap, "group.id": args.group,
                                  **CONSUMER_DEFAULTS, **CONSUMER_FIXED})
        self.producer = Producer({"bootstrap.servers": args.bootstrap, **PRODUCER_DEFAULTS})
        self.out = args.output
        self.dec = msgspec.json.Decoder()
        self.enc = msgspec.json.Encoder()
        self.done: dict[tuple[str, int], int] = {}
        self.lock = threading.Lock()
        self.interval = args.commit_interval_ms / 1000.0
        self.last_commit = time.monotonic()
        self.model_name = f"seed{args.seed}"

    def result(self, meta: tuple[Any, ...], output: Any, n: int) -> None:
        rid, key, topic, part, off, ts = meta
        now_ms = time.time() * 1000.0
        value = self.enc.encode({"id": rid, "status": "ok", "outputs": output, "model": self.model_name,
                                 "batch_size": n, "source": {"topic": topic, "partition": part,
                                                             "offset": off},
                                 "timings": {"e2e_ms": round(now_ms - ts, 3) if ts else None}})
        while True:
            try:
                self.producer.produce(self.out, value=value, key=key)
                break
            except BufferError:
                time.sleep(0.01)  # another thread serves delivery reports
        with self.lock:
            self.done[(topic, part)] = off + 1

    def maybe_commit(self, force: bool = False) -> None:
        if not force and time.monotonic() - self.last_commit < self.interval:
            return
        self.last_commit = time.monotonic()
        with self.lock:
            offsets = [KTP(t, p, o) for (t, p), o in self.done.items()]
        if not offsets:
            return
        self.producer.flush(30)
        self.consumer.commit(offsets=offsets, asynchronous=False)

    def decode(self, m: Any) -> tuple[Any, tuple[Any, ...]] | None:
        if m.error() is not None:
            return None
        req = self.dec.decode(m.value())
        ts_type, ts = m.timestamp()
        return req.get("inputs"), (req["id"], m.key(), m.topic(), m.partition(), m.offset(),
                                   ts if ts_type else 0)


def run_000(args: argparse.Namespace, g: Glue, model: SyntheticModel, running: threading.Event) -> None:
    batcher = DynamicBatcher(model.collate, max_batch_size=args.max_batch, timeout_ms=args.timeout_ms)
    metas: list[tuple[Any, ...]] = []  # the glue's records, parallel to batcher.buffer

    def run_batch(batch: Any) -> None:
        nonlocal metas
        outs = model.split(model.forward(batch), len(metas))
        for meta, out in zip(metas, outs, strict=True):
            g.result(meta, out, len(metas))
        metas = []
        g.producer.poll(0)

    while running.is_set():
        msgs = g.consumer.consume(1000, batcher.timeout)
        for m in msgs:
            d = g.decode(m)
            if d is None:
                continue
            inputs, meta = d
            metas.append(meta)
            batch = batcher.add_request(model.decode(inputs))
            if batch is not None:
                run_batch(batch)
        if not msgs and batcher.buffer:
            run_batch(batcher._process_batch())  # glue: flush the tail (the article has no timer)
        g.producer.poll(0)
        g.maybe_commit()


def run_003(args: argparse.Namespace, g: Glue, model: SyntheticModel, running: threading.Event) -> None:
    server = BatchInferenceServer(model, max_batch_size=args.max_batch, timeout_ms=args.timeout_ms)
    while running.is_set():
        msgs = g.consumer.consume(1000, 0.05)
        for m in msgs:
            d = g.decode(m)
            if d is None:
                continue
            inputs, meta = d
            # one closure per request, as the article's callbacks
            server.submit_request(model.decode(inputs), lambda out, meta=meta: g.result(meta, out, 0))
        g.producer.poll(0)
        g.maybe_commit()
    server.executor.shutdown(wait=False, cancel_futures=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", choices=["000", "003"], required=True)
    ap.add_argument("--bootstrap", required=True)
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    ap.add_argument("--group", required=True)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--timeout-ms", type=float, default=10.0)
    ap.add_argument("--a-ms", type=float, default=20.0)
    ap.add_argument("--b-ms", type=float, default=1.0)
    ap.add_argument("--host-ms", type=float, default=0.0,
                    help="the synthetic model's host work per record (collate)")
    ap.add_argument("--commit-interval-ms", type=float, default=1000.0)
    args = ap.parse_args()
    running = threading.Event()
    running.set()
    signal.signal(signal.SIGTERM, lambda *_: running.clear())
    signal.signal(signal.SIGINT, lambda *_: running.clear())
    g = Glue(args)
    model = SyntheticModel(a_ms=args.a_ms, b_ms=args.b_ms, host_ms=args.host_ms)
    g.consumer.subscribe([args.input])
    print(f"seed {args.seed} batcher started", flush=True)
    (run_000 if args.seed == "000" else run_003)(args, g, model, running)
    g.maybe_commit(force=True)
    g.consumer.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
