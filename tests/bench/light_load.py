"""End-to-end latency of one worker at light load, on a warmed local broker.

The worker runs in this process (``Runner`` on a thread, as ``worker demo`` does) with the synthetic model and
one lane; requests are produced paced at each rate in turn, after a warm-up phase (a freshly started broker's
JVM and the worker's first batches are slower). For each rate it prints end-to-end p50/p90/p99 (from the
request's Kafka timestamp to the result, ``timings.e2e_ms``) and the worker's own part (``timings.total_ms``,
received -> result encoded).

``PYTHONPATH=. python -m tests.bench.light_load [--rates 100,500,2000] [--a-ms 1] [--b-ms 0.05]
[--max-batch 64] [--max-wait-ms 5] [--seconds 5]``

Why: the loop thread cannot be woken in ``consumer.poll()`` when a device finishes, so how long it waits there
decides how long a finished result waits to be emitted at light load (``docs/design-notes.md`` item 1). With
the defaults above, polling in short steps only while the device was busy gave e2e p50 17 ms at 100/s;
polling in short steps while anything is in flight, 10.5 ms.
"""

from __future__ import annotations

import argparse
import logging
import threading
import time
from typing import Any

import msgspec
from confluent_kafka import Consumer

from tests.bench.common import Broker, create_topics, percentile, uid
from worker.app.load import load_producer, produce, requests
from worker.config.settings import from_dict
from worker.pipeline.runner import Runner


def pct(values: list[float]) -> str:
    # (interpolated, as every other figure of the bench: v[int(0.99 * n)] was one rank high, the maximum at
    # n=100)
    return (f"p50 {percentile(values, 50):6.1f} p90 {percentile(values, 90):6.1f} p99 "
            f"{percentile(values, 99):6.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="100,500,2000", help="records/s, one phase each")
    ap.add_argument("--a-ms", type=float, default=1.0)
    ap.add_argument("--b-ms", type=float, default=0.05)
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--max-wait-ms", type=float, default=5.0)
    ap.add_argument("--seconds", type=float, default=5.0,
                    help="length of each phase (at most 10,000 records)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.ERROR)
    with Broker() as broker:
        bootstrap = broker.bootstrap
        r = uid()
        names = {"in": f"light-in-{r}", "out": f"light-out-{r}", "dlq": f"light-dlq-{r}"}
        create_topics(bootstrap, {names["in"]: 4, names["out"]: 4, names["dlq"]: 1})
        cfg = from_dict({
            "kafka": {"bootstrap_servers": bootstrap, "group_id": f"light-{r}", "input_topics": [names["in"]],
                      "output_topic": names["out"], "dlq_topic": names["dlq"]},
            "model": {"name": "synthetic", "options": {"a_ms": args.a_ms, "b_ms": args.b_ms},
                      "warmup": False},
            "batching": {"lanes": [{"name": "default", "max_batch_size": args.max_batch,
                                    "max_wait_ms": args.max_wait_ms}]},
            "metrics": {"enabled": False}}, environ={})
        runner = Runner(cfg)
        loop = threading.Thread(target=runner.run, name="worker-loop", daemon=True)
        loop.start()
        runner.ready.wait(120)
        deadline = time.monotonic() + 60
        while len(runner.assigned) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        reader = Consumer({"bootstrap.servers": bootstrap, "group.id": f"light-reader-{r}",
                           "auto.offset.reset": "earliest"})
        reader.subscribe([names["out"]])
        dec = msgspec.json.Decoder()
        producers = [load_producer(bootstrap)]

        def phase(prefix: str, rate: float, n: int) -> list[dict[str, Any]]:
            producer = producers[0]
            produce(bootstrap, names["in"], requests(n, kind="synthetic", id_prefix=prefix), rate=rate,
                    producer=producer)
            got: dict[str, dict[str, Any]] = {}
            until = time.monotonic() + 60
            while len(got) < n and time.monotonic() < until:
                for m in reader.consume(1000, 0.2):
                    if m.error() is None:
                        res = dec.decode(m.value())
                        if res["id"].startswith(prefix + "-"):
                            got[res["id"]] = res
            return list(got.values())

        try:
            phase("warm", 2000, 10_000)
            print(f"synthetic a={args.a_ms:g} ms b={args.b_ms:g} ms, max batch {args.max_batch}, "
                  f"max wait {args.max_wait_ms:g} ms; e2e and in-worker (received -> result) ms")
            for rate in (float(x) for x in args.rates.split(",")):
                n = int(min(rate * args.seconds, 10_000))
                got = phase(f"r{rate:g}", rate, n)
                if not got:
                    print(f"rate {rate:6.0f}/s: no results")
                    continue
                e2e = [x["timings"]["e2e_ms"] for x in got]
                own = [x["timings"]["total_ms"] for x in got]
                print(f"rate {rate:6.0f}/s  {len(got):5d}/{n} results  e2e {pct(e2e)} | in worker {pct(own)}",
                      flush=True)
        finally:
            producers.clear()  # destroyed before the broker stops (it would log the disconnect)
            reader.close()
            runner.stop()
            loop.join(30)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
