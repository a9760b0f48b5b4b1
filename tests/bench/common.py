"""Shared benchmark plumbing: the broker, topics, load generation, reading results back, worker processes.

Throughput is always measured the same way for every system under test: output topics are created with
``message.timestamp.type=LogAppendTime``, so each result carries the broker's append time whoever produced
it (Quix Streams, for one, copies the input timestamp onto its outputs). The rate is the number of results
between the 5th and 95th percentile of those times divided by the time between them: process start-up,
group join, rebalances and the drain tail stay out of the window.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import yaml
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, Producer
from confluent_kafka import TopicPartition as KTP
from confluent_kafka.admin import AdminClient, NewTopic

ROOT = Path(__file__).resolve().parents[2]
_dec = msgspec.json.Decoder()
_enc = msgspec.json.Encoder()


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------------------------------------ broker


# The local broker keeps its data in memory (tmpfs) when there is room. On the shared 2-core VM its disk
# stalled appends and fetches for 100-200 ms, a minute or two after the pipeline scenario had written its
# results (page-cache writeback): a bare consumer's Kafka hop p99 read 40-90 ms instead of 2-3, and sweep
# points whose ideal p99 is 21-46 ms read 110-210 ms. The same sequence (pipeline, then the B=1..16 points and
# the 10% run) stalled in 3 runs of 3 with the data on disk, and in 0 of 2 on /dev/shm. Every system in a run
# uses the same broker, so this only takes out noise that is not theirs. KIW_BENCH_BROKER_DISK=1 keeps the
# data on disk.
SHM = Path("/dev/shm")
SHM_MIN_FREE = 4 << 30  # a full run writes well under 1 GB; less free than this, and disk it is


def _memory_dir() -> Path | None:
    if os.environ.get("KIW_BENCH_BROKER_DISK"):
        return None
    try:
        st = os.statvfs(SHM)
    except OSError:
        return None
    if st.f_bavail * st.f_frsize < SHM_MIN_FREE:
        return None
    return Path(tempfile.mkdtemp(prefix="kiw-kafka-", dir=SHM))


class Broker:
    """``$KAFKA_BOOTSTRAP_SERVERS`` if set, else a LocalKafka started (and stopped) by the benchmark, with its
    data on tmpfs where there is room (see SHM)."""

    def __init__(self) -> None:
        self.local: Any = None
        self.bootstrap = os.environ.get("KAFKA_BOOTSTRAP_SERVERS", "")
        self.storage = "external broker"
        self._dir: Path | None = None

    def __enter__(self) -> Broker:
        if not self.bootstrap:
            from worker.local.kafka_broker import LocalKafka

            t0 = time.monotonic()
            self._dir = _memory_dir()
            self.storage = "data on tmpfs" if self._dir is not None else "data on disk"
            try:
                self.local = LocalKafka(workdir=self._dir).start()
            except BaseException:
                self._remove_dir()
                raise
            self.bootstrap = self.local.bootstrap
            log(f"local Kafka {self.local.version} at {self.bootstrap}, {self.storage} "
                f"({time.monotonic() - t0:.1f}s)")
        else:
            log(f"using Kafka at {self.bootstrap}")
        return self

    def __exit__(self, *exc: object) -> None:
        if self.local is not None:
            self.local.close()
        self._remove_dir()

    def _remove_dir(self) -> None:
        if self._dir is not None:  # LocalKafka removes only a directory it made itself
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def uid() -> str:
    return uuid.uuid4().hex[:6]


def create_topics(bootstrap: str, topics: dict[str, int], log_append_time: Iterable[str] = ()) -> None:
    """Create topics (name -> partitions); those in ``log_append_time`` get broker timestamps."""
    stamp = set(log_append_time)
    admin = AdminClient({"bootstrap.servers": bootstrap})
    new = [NewTopic(t, num_partitions=n, replication_factor=1,
                    config={"message.timestamp.type": "LogAppendTime"} if t in stamp else {})
           for t, n in topics.items()]
    for name, fut in admin.create_topics(new, operation_timeout=30).items():
        try:
            fut.result(30)
        except Exception as e:
            if "TOPIC_ALREADY_EXISTS" not in str(e):
                raise RuntimeError(f"cannot create topic {name}: {e}") from e


# ------------------------------------------------------------------------------------------------ load


def request_value(i: int, prefix: str, inputs: Any, size: int = 0, **extra: Any) -> tuple[bytes, bytes]:
    """A request (key, JSON value); ``size`` > 0 pads ``meta`` so the value is about ``size`` bytes."""
    rid = f"{prefix}-{i}"
    body: dict[str, Any] = {"id": rid, "inputs": inputs, **extra}
    value = _enc.encode(body)
    if size and len(value) < size:
        body["meta"] = "x" * max(0, size - len(value) - 10)
        value = _enc.encode(body)
    return rid.encode(), value


def _producer(bootstrap: str, **conf: Any) -> Producer:
    return Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "enable.idempotence": True,
                     "queue.buffering.max.messages": 2_000_000,
                     "queue.buffering.max.kbytes": 1_048_576, **conf})


def _send(p: Producer, topic: str, key: bytes | None, value: bytes, partition: int | None, cb: Any) -> None:
    kw: dict[str, Any] = {"key": key, "value": value, "on_delivery": cb}
    if partition is not None:
        kw["partition"] = partition
    while True:
        try:
            p.produce(topic, **kw)
            return
        except BufferError:
            p.poll(0.05)


def produce_backlog(bootstrap: str, topic: str, items: Iterable[tuple[bytes, bytes]], partitions: int) -> int:
    """As fast as possible, partitions round-robin (even load across consumers). Returns the count."""
    p = _producer(bootstrap)
    failed: list[str] = []

    def cb(err: Any, _m: Any) -> None:
        if err is not None:
            failed.append(str(err))

    n = 0
    for n, (key, value) in enumerate(items, 1):
        _send(p, topic, key, value, (n - 1) % partitions, cb)
        if n % 1000 == 0:
            p.poll(0)
    if p.flush(120) or failed:
        raise RuntimeError(f"backlog produce failed: {failed[:1]}")
    return n


@dataclass
class Paced:
    """What a paced producer sent: per id, the topic and the wall time of ``produce()`` (ms)."""

    sent: dict[str, tuple[str, float]] = field(default_factory=dict)
    started: float = 0.0
    ended: float = 0.0
    behind_s: float = 0.0  # how far the producer fell behind its schedule at worst


def produce_paced(bootstrap: str, plan: Iterator[tuple[str, bytes, bytes]], rate: float, duration_s: float,
                  partitions: int, linger_ms: float = 0.0) -> Paced:
    """Produce ``plan`` items (topic, key, value) at ``rate``/s for ``duration_s`` (evenly spaced; keys are
    the request ids). ``linger.ms=0`` so producer-side batching is not charged to the worker's latency."""
    p = _producer(bootstrap, **{"linger.ms": linger_ms, "enable.idempotence": False})
    first = next(plan)
    # The paced producer connects before the schedule starts, and is not idempotent. An idempotent producer
    # asked to send before it is connected got its producer id 0.5-1 s later (first delivery 507 and 1041 ms
    # after produce(); 2-3 ms for a plain producer that fetched metadata first): the schedule's first second
    # reached the worker as one burst, which queued in the worker and raised the step's p99 (50%-load sweep
    # points at B=16 and 64: p99 191-207 and 117-139 ms, 53 and 69 ms without the burst; ideal 51 and 65).
    # Nothing here needs idempotence: a retried duplicate would only add a result with the same id.
    p.list_topics(first[0], timeout=30)
    plan = itertools.chain([first], plan)
    out = Paced(started=time.time())
    failed: list[str] = []

    def cb(err: Any, _m: Any) -> None:
        if err is not None:
            failed.append(str(err))

    start = time.monotonic()
    count = int(rate * duration_s)
    for n in range(count):
        due = start + n / rate
        ahead = due - time.monotonic()
        if ahead > 0:
            time.sleep(ahead)
        else:
            out.behind_s = max(out.behind_s, -ahead)
        topic, key, value = next(plan)
        _send(p, topic, key, value, n % partitions, cb)
        out.sent[key.decode()] = (topic, time.time() * 1000.0)
        p.poll(0)
    out.ended = time.time()
    p.flush(60)
    if failed:
        raise RuntimeError(f"paced produce failed: {failed[:1]}")
    return out


# ------------------------------------------------------------------------------------------------ reading


def end_count(bootstrap: str, topic: str, consumer: Consumer | None = None) -> int:
    c = consumer or Consumer({"bootstrap.servers": bootstrap, "group.id": f"probe-{uid()}"})
    try:
        md = c.list_topics(topic, timeout=10)
        return sum(c.get_watermark_offsets(KTP(topic, p), timeout=10)[1] for p in md.topics[topic].partitions)
    except KafkaException:
        return 0  # a topic created a moment ago may have no leader yet
    finally:
        if consumer is None:
            c.close()


def wait_count(bootstrap: str, topic: str, want: int, timeout: float,
               alive: Callable[[], bool] | None = None, every: float = 0.25) -> int:
    """Poll the output topic's end offsets until ``want`` records are there (cheap: no fetching). Fewer at the
    deadline is an error: a figure computed over the part that arrived would pass a worker that stalled."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"probe-{uid()}"})
    deadline = time.monotonic() + timeout
    n = 0
    try:
        while time.monotonic() < deadline:
            n = end_count(bootstrap, topic, c)
            if n >= want:
                return n
            if alive is not None and not alive():
                raise RuntimeError(f"the process under test died with {n}/{want} results on {topic}")
            time.sleep(every)
    finally:
        c.close()
    raise RuntimeError(f"only {n}/{want} results on {topic} after {timeout:.0f} s")


def read_topic(bootstrap: str, topic: str, want: int | None = None, timeout: float = 120.0,
               idle_s: float = 2.0) -> list[tuple[int, bytes]]:
    """(broker timestamp ms, value) of every record, reading all partitions from the beginning."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{uid()}", "enable.auto.commit": False,
                  "fetch.max.bytes": 52428800, "max.partition.fetch.bytes": 10485760})
    try:
        md = c.list_topics(topic, timeout=10)
        parts = list(md.topics[topic].partitions)
        ends = {p: c.get_watermark_offsets(KTP(topic, p), timeout=10)[1] for p in parts}
        c.assign([KTP(topic, p, OFFSET_BEGINNING) for p in parts])
        total = sum(ends.values()) if want is None else want
        out: list[tuple[int, bytes]] = []
        deadline = time.monotonic() + timeout
        last = time.monotonic()
        while len(out) < total and time.monotonic() < deadline:
            msgs = c.consume(10000, 0.5)
            for m in msgs:
                if m.error() is None:
                    out.append((m.timestamp()[1], m.value()))
            if msgs:
                last = time.monotonic()
            elif want is None and time.monotonic() - last > idle_s:
                break
        return out
    finally:
        c.close()


def decode_results(rows: list[tuple[int, bytes]]) -> list[tuple[int, dict[str, Any]]]:
    return [(ts, _dec.decode(v)) for ts, v in rows]


def window_rate(ts_ms: list[int], lo: float = 0.05, hi: float = 0.95) -> float:
    """Results per second between the ``lo`` and ``hi`` quantiles of the broker append times."""
    if len(ts_ms) < 20:
        return float("nan")
    s = sorted(ts_ms)
    i, j = int(lo * (len(s) - 1)), int(hi * (len(s) - 1))
    dt = (s[j] - s[i]) / 1000.0
    return (j - i) / dt if dt > 0 else float("nan")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    f = int(k)
    c = min(f + 1, len(s) - 1)
    return s[f] + (s[c] - s[f]) * (k - f)


# ------------------------------------------------------------------------------------------------ processes


def bench_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


class Proc:
    """A child process (worker or baseline) with its output in a log file."""

    def __init__(self, name: str, argv: list[str], workdir: Path, env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log_path = workdir / f"{name}.log"
        out = open(self.log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env or bench_env(),
                                     cwd=str(ROOT), start_new_session=True)
        out.close()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_for_log(self, pattern: str, timeout: float = 120.0) -> re.Match[str]:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = rx.search(self.log())
            if m:
                return m
            if not self.alive():
                break
            time.sleep(0.2)
        raise RuntimeError(f"{self.name}: no {pattern!r} in its log after {timeout:.0f}s "
                           f"(exit {self.proc.poll()}):\n{self.log()[-3000:]}")

    def stop(self, timeout: float = 30.0) -> int | None:
        if self.alive():
            try:
                self.proc.send_signal(signal.SIGTERM)
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode


def worker_config(bootstrap: str, group: str, output: str, dlq: str, *, topics: list[str] | None = None,
                  lanes: list[dict[str, Any]] | None = None, model: dict[str, Any] | None = None,
                  batching: dict[str, Any] | None = None, metrics: bool = False,
                  kafka: dict[str, Any] | None = None,
                  delivery: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "kafka": {"bootstrap_servers": bootstrap, "group_id": group, "input_topics": topics or [],
                  "output_topic": output, "dlq_topic": dlq, **(kafka or {})},
        "model": {"device": "cpu", **(model or {"name": "identity"})},
        "batching": {"lanes": lanes or [{"name": "default"}], **(batching or {})},
        "delivery": {"shutdown_timeout_s": 5, **(delivery or {})},
        "metrics": {"enabled": metrics, "port": 0},
        "logging": {"level": "INFO", "format": "json"},
    }
    return cfg


def start_worker(name: str, cfg: dict[str, Any], workdir: Path, metrics: bool = False) -> Proc:
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    argv = [sys.executable, "-m", "worker", "run", "--config", str(path)]
    if metrics:
        argv += ["--metrics-port", "0"]
    return Proc(name, argv, workdir)


def wait_assigned(proc: Proc, timeout: float = 120.0) -> None:
    proc.wait_for_log(r"partitions assigned", timeout)


def metrics_port(proc: Proc, timeout: float = 120.0) -> int:
    return int(proc.wait_for_log(r"metrics and health on port (\d+)", timeout).group(1))


def scrape(port: int) -> dict[str, float]:
    """kiw_* samples summed over their labels."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("kiw_"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        try:
            out[name] = out.get(name, 0.0) + float(value)
        except ValueError:
            pass
    return out


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process, all its threads (librdkafka's included)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def rss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class Sampler(threading.Thread):
    """Calls ``fn()`` every ``every`` seconds in the background; keeps (t, value) pairs."""

    def __init__(self, fn: Callable[[], Any], every: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.every = every
        self.samples: list[tuple[float, Any]] = []
        self._stop_ev = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        nxt = time.monotonic()
        while not self._stop_ev.is_set():
            try:
                self.samples.append((time.monotonic() - self.t0, self.fn()))
            except Exception as e:  # noqa: BLE001 - a missed sample is not fatal
                self.samples.append((time.monotonic() - self.t0, {"error": str(e)}))
            nxt += self.every
            self._stop_ev.wait(max(0.0, nxt - time.monotonic()))

    def stop(self) -> None:
        self._stop_ev.set()
        self.join(5)


class KafkaFloor(threading.Thread):
    """A bare consumer (own group, every partition of ``topic`` from the start, the worker's fetch settings)
    that records, per request, receive time - the request's Kafka timestamp: the latency of the Kafka hop
    alone on this machine, measured beside the worker in the same run."""

    def __init__(self, bootstrap: str, topic: str, partitions: int) -> None:
        super().__init__(daemon=True, name="kafka-floor")
        self.c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"floor-{uid()}",
                           "enable.auto.commit": False,
                           "fetch.wait.max.ms": 50, "auto.offset.reset": "earliest"})
        self.c.assign([KTP(topic, p, OFFSET_BEGINNING) for p in range(partitions)])
        self.lag_ms: dict[str, float] = {}  # request key -> receive delay
        self._halt = threading.Event()

    def run(self) -> None:
        while not self._halt.is_set():
            m = self.c.poll(0.05)
            if m is None or m.error() is not None:
                continue
            now = time.time() * 1000.0
            self.lag_ms[(m.key() or b"").decode()] = now - m.timestamp()[1]

    def stop(self) -> dict[str, float]:
        self._halt.set()
        self.join(5)
        self.c.close()
        return self.lag_ms


def workdir() -> Path:
    return Path(tempfile.mkdtemp(prefix="kiw-bench-"))


def dump(obj: Any) -> str:
    return json.dumps(obj, indent=2, sort_keys=True, default=str)


# ------------------------------------------------------------------------------------------------ table


@dataclass
class Ctx:
    bootstrap: str
    work: Path
    quick: bool
    run: str = field(default_factory=uid)


def row(scenario: str, figure: str, value: float, baseline: str, baseline_value: float, op: str,
        target: float,
        unit: str = "", note: str = "") -> dict[str, Any]:
    """One line of the summary table: ``ratio = value / baseline_value`` checked against ``op target``."""
    ratio = value / baseline_value if baseline_value and baseline_value == baseline_value else float("nan")
    if op == "info":
        verdict = "info"
    elif ratio != ratio:
        verdict = "FAIL"  # a figure with a target that could not be measured fails the run (run_all exits 1)
    elif op == ">=":
        verdict = "pass" if ratio >= target else "MISS"
    else:
        verdict = "pass" if ratio <= target else "MISS"
    return {"scenario": scenario, "figure": figure, "value": round(value, 3), "unit": unit,
            "baseline": baseline,
            "baseline_value": round(baseline_value, 3), "ratio": round(ratio, 3),
            "target": "-" if op == "info" else f"{op} {target:g}",
            "verdict": verdict, "note": note}
