"""Test helpers against a real broker: topics, producing, reading back, offsets, worker processes, and
``Scenario``, which puts them together for one test's run."""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import msgspec
import yaml
from confluent_kafka import Consumer, Producer
from confluent_kafka import TopicPartition as KTP

from worker.kafka.clients import ensure_topics, retry_transient

ROOT = Path(__file__).resolve().parents[2]
_dec = msgspec.json.Decoder()


def create_topics(bootstrap: str, topics: dict[str, int]) -> None:
    ensure_topics(bootstrap, topics)


def produce_values(bootstrap: str, topic: str, items: list[tuple[bytes | None, bytes]],
                   partition: int | None = None, headers: list[tuple[str, bytes]] | None = None) -> None:
    p = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "enable.idempotence": True})
    errors: list[str] = []

    def cb(err: Any, _m: Any) -> None:
        if err is not None:
            errors.append(str(err))

    for key, value in items:
        kw: dict[str, Any] = {"value": value, "key": key, "on_delivery": cb}
        if partition is not None:
            kw["partition"] = partition
        if headers:
            kw["headers"] = headers
        while True:
            try:
                p.produce(topic, **kw)
                break
            except BufferError:
                p.poll(0.05)
        p.poll(0)
    assert p.flush(60) == 0
    assert not errors, errors


def request(i: int, prefix: str = "r", inputs: Any = None, **extra: Any) -> tuple[bytes, bytes]:
    rid = f"{prefix}-{i}"
    body = {"id": rid, "inputs": inputs if inputs is not None else [0.01 * (i % 100)] * 16, **extra}
    return rid.encode(), msgspec.json.encode(body)


def read_all(bootstrap: str, topic: str, *, want: int | None = None, timeout: float = 60.0,
             idle: float = 3.0, read_committed: bool = True) -> list[Any]:
    """Reads ``topic`` from the beginning until ``want`` records were seen (or, without ``want``, until
    nothing new arrived for ``idle`` seconds), or ``timeout``. Returns confluent Message objects."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"reader-{uuid.uuid4().hex[:8]}",
                  "auto.offset.reset": "earliest", "enable.auto.commit": False,
                  "isolation.level": "read_committed" if read_committed else "read_uncommitted"})
    c.subscribe([topic])
    out: list[Any] = []
    deadline = time.monotonic() + timeout
    last_new = time.monotonic()
    try:
        while time.monotonic() < deadline:
            msgs = c.consume(1000, 0.3)
            got = [m for m in msgs if m.error() is None]
            if got:
                out.extend(got)
                last_new = time.monotonic()
            if want is not None and len(out) >= want:
                # a little longer, to catch records beyond ``want`` (duplicates) that are already there
                extra_until = time.monotonic() + 1.0
                while time.monotonic() < extra_until:
                    out.extend(m for m in c.consume(1000, 0.2) if m.error() is None)
                break
            if want is None and time.monotonic() - last_new > idle:
                break
    finally:
        c.close()
    return out


def decode(msgs: list[Any]) -> list[dict[str, Any]]:
    return [_dec.decode(m.value()) for m in msgs]


def once_each_in_source_order(msgs: list[Any], ids: set[str]) -> list[dict[str, Any]]:
    """Asserts that the results ``msgs`` hold each of ``ids`` exactly once and that, as results are written
    per input partition in offset order, within each output partition the results of one input partition
    stand in increasing source offset. Returns them decoded."""
    values = decode(msgs)
    seen = collections.Counter(r["id"] for r in values)
    assert set(seen) == ids and max(seen.values()) == 1
    last: dict[tuple[int, int], int] = {}
    for m, r in zip(msgs, values, strict=True):
        k = (m.partition(), r["source"]["partition"])
        assert r["source"]["offset"] > last.get(k, -1), (f"out of order in output partition {k[0]}: "
                                                         f"{r['source']}")
        last[k] = r["source"]["offset"]
    return values


def end_offsets(bootstrap: str, topic: str) -> dict[int, int]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"probe-{uuid.uuid4().hex[:6]}"})
    try:
        md = c.list_topics(topic, timeout=10)
        return {p: retry_transient(c.get_watermark_offsets, KTP(topic, p), timeout=10)[1]
                for p in md.topics[topic].partitions}
    finally:
        c.close()


def committed_offsets(bootstrap: str, group: str, topic: str, *, stable: bool = True) -> dict[int, int]:
    """The group's committed offsets per partition. ``stable`` (read_committed, librdkafka's default): while a
    transaction holds offsets for the group the broker answers "unstable" and the call waits for its end.
    ``stable=False`` gets the last offsets committed before it at once: what counts when the transaction's
    producer was just killed (it is aborted only when it times out or its transactional.id starts again)."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                  "isolation.level": "read_committed" if stable else "read_uncommitted"})
    try:
        md = c.list_topics(topic, timeout=10)
        parts = [KTP(topic, p) for p in md.topics[topic].partitions]
        return {k.partition: k.offset for k in retry_transient(c.committed, parts, timeout=10)}
    finally:
        c.close()


def member_with_partitions(bootstrap: str, group: str, topic: str, strategy: str,
                           timeout: float = 60.0) -> Consumer:
    """Another member of ``group`` on ``topic`` (assignor ``strategy``), returned once it holds a partition;
    the caller polls it to stay and closes it to leave."""
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                  "partition.assignment.strategy": strategy,
                  "enable.auto.commit": False, "session.timeout.ms": 10000, "log_level": 0})
    c.subscribe([topic])
    deadline = time.monotonic() + timeout
    while not c.assignment() and time.monotonic() < deadline:
        c.poll(0.2)
    if not c.assignment():
        c.close()
        raise AssertionError("the other member never got a partition")
    return c


def wait_for(pred: Any, timeout: float, interval: float = 0.25, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def worker_config(bootstrap: str, names: dict[str, str], group: str | None = None,
                  **sections: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {
        "kafka": {"bootstrap_servers": bootstrap, "group_id": group or f"g-{names['run']}",
                  "input_topics": [names["in"]], "output_topic": names["out"], "dlq_topic": names["dlq"],
                  "commit_interval_ms": 500,
                  "consumer": {"session.timeout.ms": 10000, "heartbeat.interval.ms": 1000}},
        "model": {"name": "tiny", "device": "cpu", "warmup": False},
        "metrics": {"enabled": False},
        "logging": {"level": "INFO", "format": "json"},
    }
    for section, values in sections.items():
        if isinstance(values, dict) and isinstance(cfg.get(section), dict):
            merged = dict(cfg[section])
            for k, v in values.items():
                if isinstance(v, dict) and isinstance(merged.get(k), dict):
                    merged[k] = {**merged[k], **v}
                else:
                    merged[k] = v
            cfg[section] = merged
        else:
            cfg[section] = values
    return cfg


class WorkerProcess:
    """``python -m worker <command> --config F`` as a child process, logs to a file."""

    def __init__(self, config: dict[str, Any], tmp: Path, command: str = "run",
                 extra_args: list[str] | None = None,
                 env: dict[str, str] | None = None, name: str | None = None) -> None:
        self.name = name or f"worker-{uuid.uuid4().hex[:4]}"
        self.config_path = tmp / f"{self.name}.yaml"
        self.config_path.write_text(yaml.safe_dump(config))
        self.log_path = tmp / f"{self.name}.log"
        self.command = command
        self.extra_args = extra_args or []
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "worker", self.command, "--config",
                                      str(self.config_path), *self.extra_args],
                                     stdout=log, stderr=subprocess.STDOUT, env=self.env, cwd=str(ROOT))
        log.close()
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def wait_assigned(self, timeout: float = 90.0) -> None:
        wait_for(
            lambda: (
                "partitions assigned" in self.log()
                or (self.proc is not None and self.proc.poll() is not None)
            ),
            timeout,
            what=f"{self.name} to get partitions",
        )
        assert self.proc is not None and self.proc.poll() is None, (f"{self.name} exited "
                                                                    f"early:\n{self.log()[-4000:]}")

    def signal(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)

    def wait(self, timeout: float = 60.0) -> int:
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"{self.name} did not exit in {timeout}s:\n{self.log()[-4000:]}") from None

    def stop(self, timeout: float = 60.0) -> int:
        self.signal(signal.SIGTERM)
        return self.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


class Scenario:
    """One test's run on a real broker: its topics (``names``: ``in``, ``out``, ``dlq``, ``run``), its
    workers' files under ``tmp``, and the bootstrap address of the test's own clients (a secured broker's
    workers may use another listener). A worker is served to the end when every result is out and its
    group's commits reached the end offsets of the input, before it stops gracefully."""

    def __init__(self, bootstrap: str, names: dict[str, str], tmp: Path) -> None:
        self.bootstrap = bootstrap
        self.names = names
        self.tmp = tmp

    def topics(self, partitions: int) -> None:
        """The input and output topics with ``partitions`` each, and a one-partition dead-letter topic."""
        create_topics(self.bootstrap, {self.names["in"]: partitions, self.names["out"]: partitions,
                                       self.names["dlq"]: 1})

    def produce(self, items: list[tuple[bytes | None, bytes]], partition: int | None = None,
                headers: list[tuple[str, bytes]] | None = None) -> None:
        produce_values(self.bootstrap, self.names["in"], items, partition=partition, headers=headers)

    def config(self, group: str | None = None, **sections: Any) -> dict[str, Any]:
        """``worker_config`` for this run's topics (group ``g-<run>`` unless named)."""
        return worker_config(self.bootstrap, self.names, group, **sections)

    def read_out(self, **kw: Any) -> list[Any]:
        """The output topic's records, as ``read_all`` reads them."""
        return read_all(self.bootstrap, self.names["out"], **kw)

    def read_dlq(self, **kw: Any) -> list[Any]:
        return read_all(self.bootstrap, self.names["dlq"], **kw)

    def committed_to_end(self, group: str, timeout: float) -> dict[int, int]:
        """Waits until ``group``'s commits on the input equal its end offsets; returns them."""
        topic = self.names["in"]
        ends = end_offsets(self.bootstrap, topic)
        wait_for(lambda: committed_offsets(self.bootstrap, group, topic) == ends, timeout,
                 what=f"{group}'s commits on {topic} to reach the end offsets {ends}")
        return ends

    def delivered(self, group: str, *, want: int, timeout: float, commit_timeout: float = 30.0) -> list[Any]:
        """The first ``want`` results (and any beyond them already there), once ``group`` committed the
        input to its end."""
        results = self.read_out(want=want, timeout=timeout)
        self.committed_to_end(group, commit_timeout)
        return results

    @contextmanager
    def worker(self, config: dict[str, Any], **kw: Any) -> Iterator[WorkerProcess]:
        """A started ``WorkerProcess`` (``kw`` as its constructor takes them): when the block ends it must
        stop gracefully with exit 0; when the block fails it is killed."""
        w = WorkerProcess(config, self.tmp, **kw).start()
        try:
            yield w
            assert w.stop() == 0, w.log()[-4000:]
        finally:
            w.kill()

    def serve(self, config: dict[str, Any], *, want: int, timeout: float, commit_timeout: float = 30.0,
              assigned_first: bool = False, **kw: Any) -> tuple[list[Any], WorkerProcess]:
        """Runs a worker on ``config`` until ``want`` results are out and its group committed the input to
        the end, then stops it (exit 0). ``assigned_first``: it must hold partitions before the results are
        awaited. Returns the results (confluent Messages) and the stopped worker (for its log)."""
        with self.worker(config, **kw) as w:
            if assigned_first:
                w.wait_assigned()
            results = self.delivered(config["kafka"]["group_id"], want=want, timeout=timeout,
                                     commit_timeout=commit_timeout)
        return results, w
