"""``worker demo``: the main job on an embedded default, from nothing to a summary in one command."""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import uuid
from typing import Any

import msgspec

from worker.config.settings import from_dict

log = logging.getLogger("worker.demo")

CONNECT_TIMEOUT_S = 30.0  # for a broker given with --bootstrap or $KAFKA_BOOTSTRAP_SERVERS to answer


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100.0 * (len(s) - 1))))]


def demo(records: int = 5000, model: str = "tiny", bootstrap: str | None = None, partitions: int = 4,
         rate: float = 2000.0, warm_up_s: float | None = None) -> int:
    from confluent_kafka import Consumer

    from worker.app.command_support import unreachable_broker_is_an_error
    from worker.app.load import load_producer, produce, requests
    from worker.kafka.clients import ensure_topics
    from worker.pipeline.runner import Runner

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    broker = None
    bootstrap_arg = bootstrap
    bootstrap = bootstrap or os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    t_start = time.monotonic()
    if not bootstrap:
        from worker.local.kafka_broker import LocalKafka

        print("starting a local Apache Kafka broker (KRaft) ...", flush=True)
        broker = LocalKafka()
        try:
            broker.start()
        except BaseException:
            broker.close()  # a failed or interrupted start leaves no process or temp dir behind
            raise
        bootstrap = broker.bootstrap
        print(f"  broker {broker.version} ready at {bootstrap} in {time.monotonic() - t_start:.1f}s",
              flush=True)
    if warm_up_s is None:
        warm_up_s = 5.0 if broker is not None else 0.0
    run_id = uuid.uuid4().hex[:6]
    topics = {"in": f"demo-requests-{run_id}", "out": f"demo-results-{run_id}", "dlq": f"demo-dlq-{run_id}",
              "warm": f"demo-warmup-{run_id}"}
    source = "--bootstrap" if bootstrap_arg else "$KAFKA_BOOTSTRAP_SERVERS"
    worker: _WorkerThread | None = None
    try:
        # (A local broker the demo started itself is not the reader's to fix: its errors go as they are.)
        with (unreachable_broker_is_an_error(bootstrap, source, CONNECT_TIMEOUT_S) if broker is None
              else contextlib.nullcontext()):
            ensure_topics(bootstrap, {topics["in"]: partitions, topics["out"]: partitions, topics["dlq"]: 1,
                                      **({topics["warm"]: partitions} if warm_up_s > 0 else {})},
                          timeout=CONNECT_TIMEOUT_S)
        cfg = from_dict({
            "kafka": {"bootstrap_servers": bootstrap, "group_id": f"demo-{run_id}",
                      "input_topics": [topics["in"]],
                      "output_topic": topics["out"], "dlq_topic": topics["dlq"]},
            "model": {"name": model, "device": "cpu"},
            "batching": {"lanes": [{"name": "default", "max_batch_size": 64, "max_wait_ms": 5}]},
            "metrics": {"enabled": False},
        }, environ={})
        print(f"loading model {model!r} ...", flush=True)
        runner = Runner(cfg)
        worker = _WorkerThread(runner)
        t = worker.thread
        # One producer for everything: its first flush waits for its idempotent producer id (~0.5 s on a fresh
        # broker), which would otherwise show as the first records' latency.
        p = load_producer(bootstrap)
        if warm_up_s > 0:
            # While the model loads. A broker just started has not compiled its request paths yet: for its
            # first seconds a produce -> fetch round trip took 20-80 ms at p50 instead of 5-10 (2-core VM),
            # and the summary showed that rather than the worker. A broker given with --bootstrap is warm
            # already.
            print(f"warming up the broker ({warm_up_s:g} s of throwaway traffic) ...", flush=True)
            _warm_broker(bootstrap, topics["warm"], partitions, p, seconds=warm_up_s, rate=rate)
        if not worker.wait_ready(300):
            print("worker did not start in time")
            return 1
        # Produce only once the group has handed the worker its partitions: records produced during the join
        # would wait for it, and the summary would show the join (seconds) as end-to-end latency.
        deadline = time.monotonic() + 60
        while len(runner.assigned) < partitions and time.monotonic() < deadline and t.is_alive():
            time.sleep(0.05)
        worker.check()
        if len(runner.assigned) < partitions:
            print(f"worker was assigned {len(runner.assigned)} of {partitions} partitions in 60 s")
            worker.stop()
            return 1
        print(f"producing {records} requests (+2 malformed) at {rate:.0f}/s to {topics['in']} ...",
              flush=True)
        produce(bootstrap, topics["in"], iter([(b"bad-1", b"{not json"), (b"bad-2", b'{"id": "bad-2"}')]),
                producer=p)
        t0_ms = time.time() * 1000
        produce(bootstrap, topics["in"], requests(records, kind=model, id_prefix=f"demo-{run_id}"), rate=rate,
                producer=p)
        del p  # flushed: destroy it now, not after the local broker stops (it would log the disconnect)

        results, last_ms = _collect(Consumer, bootstrap, topics["out"], records + 1, timeout=180)
        worker.check()
        # From the first request produced to the last result written (its Kafka timestamp), so the reader's
        # own start-up is not counted.
        elapsed = max(last_ms - t0_ms, 1.0) / 1000
        worker.stop()
        st = runner.stats
        ok = [r for r in results if r.get("status") == "ok"]
        e2e = [r["timings"]["e2e_ms"] for r in ok if r.get("timings", {}).get("e2e_ms") is not None]
        ids = {r["id"] for r in ok}
        print()
        print("demo summary")
        print(f"  records in        {st.records_in}")
        print(f"  results out       {len(results)} ({len(ok)} ok, {len(results) - len(ok)} error)")
        print(f"  distinct ok ids   {len(ids)} of {records}")
        print(f"  dead letters      {st.dlq}")
        print(f"  batches           {st.batches}")
        print(f"  mean batch size   {st.mean_batch:.1f}")
        print(f"  records/s         {len(results) / elapsed:.0f} (offered {rate:.0f}/s)")
        print(f"  end-to-end p50    {percentile(e2e, 50):.1f} ms")
        print(f"  end-to-end p99    {percentile(e2e, 99):.1f} ms")
        print(f"  total time        {time.monotonic() - t_start:.1f}s")
        return 0 if len(ids) == records and st.dlq == 2 else 1
    finally:
        try:
            if worker is not None:
                # Ctrl-C, an error: the worker first, or its clients log "connection refused" at the broker
                # stopping under them.
                worker.stop()
        finally:
            if broker is not None:
                broker.close()
                print("local broker stopped")


class _WorkerThread:
    """``Runner.run`` on a thread of its own, keeping what it raised for the main thread."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="worker-loop", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.runner.run()
        except BaseException as e:  # re-raised on the main thread (wait_ready, check)
            self.error = e
            if self.runner.ready.is_set():
                # Past start-up the main thread may be waiting on results for minutes: say it now.
                log.error("worker stopped: %s: %s", type(e).__name__, e, exc_info=e)

    def check(self) -> None:
        """Raises what the worker thread died of, if it died of something."""
        if self.error is not None and not self.thread.is_alive():
            raise self.error

    def wait_ready(self, timeout: float) -> bool:
        """True once the worker runs. Raises what the thread died of (a ConfigError: exit 2 with its message),
        at once rather than after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not self.runner.ready.wait(0.1):
            if not self.thread.is_alive():
                if self.error is not None:
                    raise self.error
                print("worker stopped before it started")
                return False
            if time.monotonic() >= deadline:
                return False
        return True

    def stop(self, timeout: float = 60.0) -> None:
        if self.thread.is_alive():
            self.runner.stop()
            self.thread.join(timeout)


def _warm_broker(bootstrap: str, topic: str, partitions: int, producer: Any, seconds: float = 5.0,
                 rate: float = 2000.0) -> None:
    """A throwaway stream through the broker, produced and fetched at the demo's pace: what warms its JIT is
    the number of produce and fetch requests it serves, not their size."""
    from confluent_kafka import OFFSET_BEGINNING, Consumer, TopicPartition

    from worker.app.load import produce, requests
    from worker.kafka.clients import client_log

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"demo-warmup-{uuid.uuid4().hex[:6]}",
                  "enable.auto.commit": False, "fetch.wait.max.ms": 50, "logger": client_log("demo")})
    c.assign([TopicPartition(topic, i, OFFSET_BEGINNING) for i in range(partitions)])  # no group join
    done = threading.Event()

    def fetch() -> None:
        while not done.is_set():
            c.poll(0.1)

    reader = threading.Thread(target=fetch, name="demo-warmup", daemon=True)
    reader.start()
    try:
        produce(bootstrap, topic, requests(int(seconds * rate), id_prefix="warmup"), rate=rate,
                producer=producer)
    finally:
        done.set()
        reader.join(5)
        c.close()


def _collect(consumer_cls: Any, bootstrap: str, topic: str, want: int,
             timeout: float) -> tuple[list[dict[str, Any]], float]:
    """The decoded results, and the latest Kafka timestamp among them (epoch ms)."""
    from worker.kafka.clients import client_log

    c = consumer_cls({"bootstrap.servers": bootstrap, "group.id": f"demo-reader-{uuid.uuid4().hex[:6]}",
                      "auto.offset.reset": "earliest", "enable.auto.commit": False,
                      "logger": client_log("demo")})
    c.subscribe([topic])
    out: list[dict[str, Any]] = []
    last_ms = 0.0
    deadline = time.monotonic() + timeout
    dec = msgspec.json.Decoder()
    try:
        while len(out) < want and time.monotonic() < deadline:
            for m in c.consume(1000, 0.5):
                if m.error() is None:
                    out.append(dec.decode(m.value()))
                    last_ms = max(last_ms, float(m.timestamp()[1]))
    finally:
        c.close()
    return out, last_ms
