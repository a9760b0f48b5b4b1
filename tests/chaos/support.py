"""Chaos-test helpers: a live view of the output topic, a supervisor that kills and restarts worker processes,
and the one-line report every chaos test prints.

The supervisor judges progress by what a reader sees on the output topic (distinct expected ids), not by the
worker's logs: a kill point "at 40 %" means "once 40 % of the ids have a visible result".
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient

from tests.support.kafka_io import WorkerProcess, committed_offsets, end_offsets, read_all, wait_for

_dec = msgspec.json.Decoder()

# The watcher reads with a new consumer when nothing new came for this long while the topic has more: a client
# that was connected while the broker was frozen can stay stuck after it resumes (an admin client did in one
# CI run, see broker_healthy), and a stuck watcher fails the test for want of progress the worker made.
REOPEN_AFTER_S = 15.0


class OutputWatcher:
    """Reads a topic from the beginning in a background thread; counts result ids (and, optionally, keeps
    every decoded value). ``read_committed`` as the readers of an exactly-once pipeline would use."""

    def __init__(self, bootstrap: str, topic: str, *, read_committed: bool = True) -> None:
        self.ids: Counter[str] = Counter()
        self.records = 0
        self.max_source: dict[int, int] = {}  # input partition -> highest source offset with a visible result
        self.reopened = 0  # times it went on with a new consumer (REOPEN_AFTER_S)
        self.bootstrap, self.topic = bootstrap, topic
        self._next: dict[int, int] = {}  # output partition -> the offset after the last record read
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._conf = {
            "bootstrap.servers": bootstrap, "group.id": f"watch-{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest", "enable.auto.commit": False,
            "isolation.level": "read_committed" if read_committed else "read_uncommitted",
            "log_level": 0,
        }
        self._consumer = Consumer(self._conf)
        self._consumer.subscribe([topic])
        self._thread = threading.Thread(target=self._loop, name=f"watch-{topic}", daemon=True)

    def __enter__(self) -> OutputWatcher:
        self._thread.start()
        return self

    def __exit__(self, *_: Any) -> None:
        self.close()

    def _loop(self) -> None:
        idle_since = time.monotonic()
        while not self._stop.is_set():
            msgs = self._consumer.consume(2000, 0.2)
            got = []
            sources: list[tuple[int, int]] = []
            nxt: dict[int, int] = {}
            for m in msgs:
                if m.error() is not None:
                    continue
                nxt[m.partition()] = m.offset() + 1
                try:
                    v = _dec.decode(m.value())
                    got.append(v["id"])
                    src = v.get("source") or {}
                    if isinstance(src.get("partition"), int) and isinstance(src.get("offset"), int):
                        sources.append((src["partition"], src["offset"]))
                except Exception:  # noqa: BLE001 - not a result: counted, not an id
                    got.append(None)
            if got:
                idle_since = time.monotonic()
                with self._lock:  # describe() reads _next from the test's thread
                    self._next.update(nxt)
                    self.records += len(got)
                    self.ids.update(i for i in got if i is not None)
                    for p, o in sources:
                        if o > self.max_source.get(p, -1):
                            self.max_source[p] = o
            elif time.monotonic() - idle_since > REOPEN_AFTER_S:
                idle_since = time.monotonic()
                self._reopen_if_behind()

    def _reopen_if_behind(self) -> None:
        """Nothing new for REOPEN_AFTER_S: if the topic holds records past what was read (asked with a new
        client), go on from there with a new consumer; the old one closes on a thread (its close may hang
        too). With read_committed, an aborted transaction at a partition's end looks the same: a harmless
        re-read."""
        try:
            ends = end_offsets(self.bootstrap, self.topic)
        except Exception:  # noqa: BLE001 - the broker may be down: try again later
            return
        behind = {p: e for p, e in ends.items() if e > self._next.get(p, 0)}
        if not behind:
            return
        print(f"[watch] nothing new from {self.topic} for {REOPEN_AFTER_S:.0f} s while it has more "
              f"({behind}, read up to {self._next}): reading on with a new consumer", file=sys.stderr,
              flush=True)
        old, self._consumer = self._consumer, Consumer(self._conf)
        self._consumer.assign([TopicPartition(self.topic, p,
                                              self._next.get(p, OFFSET_BEGINNING)) for p in ends])
        threading.Thread(target=old.close, name="watch-close", daemon=True).start()
        self.reopened += 1

    def wait_assigned(self, timeout: float = 60.0) -> None:
        """Until the reader holds the topic's partitions: a run judged by what it reads cannot start before it
        reads (on a fresh broker its group's coordinator can take seconds to load, while the worker's group,
        on another coordinator, goes ahead and passes several kill points unseen)."""
        wait_for(lambda: bool(self._consumer.assignment()), timeout, interval=0.05,
                 what=f"the reader of {self.topic} to get its partitions")

    def describe(self) -> str:
        """For a test's failure message: what it read, how far, how often it reopened."""
        with self._lock:
            return (f"watcher: {self.records} records, {len(self.ids)} ids, read up to "
                    f"{dict(sorted(self._next.items()))} of {self.topic}, reopened {self.reopened}x")

    def visible_ends(self) -> dict[int, int]:
        """Per input partition: one past the highest source offset that has a visible result."""
        with self._lock:
            return {p: o + 1 for p, o in self.max_source.items()}

    def seen(self, expected: set[str]) -> int:
        """How many of ``expected`` have at least one result."""
        with self._lock:
            return sum(1 for i in self.ids if i in expected)

    def close(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            if self._thread.is_alive():
                self._thread.join(10)
            self._consumer.close()


def kill_points(n: int, k: int, seed: int, lo: float = 0.05, hi: float = 0.9,
                min_gap: float = 0.08) -> list[int]:
    """``k`` progress thresholds in ``[lo*n, hi*n]``, at least ``min_gap*n`` apart, from a seeded RNG."""
    rng = random.Random(seed)
    for _ in range(10_000):
        f = sorted(rng.uniform(lo, hi) for _ in range(k))
        if all(b - a >= min_gap for a, b in zip(f, f[1:], strict=False)):
            return [int(x * n) for x in f]
    raise ValueError("cannot place the kill points with that gap")


@dataclass
class Incident:
    kind: str  # "kill" (SIGKILL by the supervisor) | "exit" (the worker died by itself)
    worker: str
    elapsed_s: float
    progress: int
    returncode: int | None = None
    log_tail: str = ""


@dataclass
class Supervision:
    incidents: list[Incident] = field(default_factory=list)
    workers: list[WorkerProcess] = field(default_factory=list)
    elapsed_s: float = 0.0
    finished: bool = False

    @property
    def kills(self) -> list[Incident]:
        return [i for i in self.incidents if i.kind == "kill"]

    @property
    def exits(self) -> list[Incident]:
        return [i for i in self.incidents if i.kind == "exit"]

    @property
    def current(self) -> WorkerProcess:
        return self.workers[-1]

    def logs(self, tail: int = 3000) -> str:
        return "\n".join(f"--- {w.name} ---\n{w.log()[-tail:]}" for w in self.workers)


def supervise(make_worker: Callable[[int], WorkerProcess], progress: Callable[[], int], target: int, *,
              kill_at: Iterable[int] = (), deadline_s: float = 150.0, restart_exits: bool = True,
              max_exits: int = 10, tick: Callable[[Supervision], None] | None = None,
              on_kill: Callable[[Incident], None] | None = None, poll_s: float = 0.05,
              diagnose: Callable[[], str] | None = None) -> Supervision:
    """Runs worker incarnations ``make_worker(0), make_worker(1), ...`` until ``progress() >= target``.

    - Each time ``progress()`` passes the next value of ``kill_at``, the live worker is SIGKILLed (kill -9),
      ``on_kill(incident)`` is called (before the next worker starts: the state the kill left), and a new one
      started.
    - A worker that exits by itself is recorded (return code, log tail) and, with ``restart_exits``,
      restarted, up to ``max_exits`` times.
    - Past ``deadline_s`` the last worker is killed and AssertionError raised with the incidents, what
      ``diagnose()`` says (where the group's commits and the topics stand, say) and the logs.

    The last worker is left running (the caller checks it is healthy and stops it).
    """
    sup = Supervision()
    pending = sorted(kill_at)
    t0 = time.monotonic()
    sup.workers.append(make_worker(0).start())
    try:
        while True:
            now = time.monotonic() - t0
            done = progress()
            if done >= target:
                sup.finished = True
                break
            w = sup.current
            assert w.proc is not None
            rc = w.proc.poll()
            if rc is not None:
                sup.incidents.append(Incident("exit", w.name, now, done, rc, w.log()[-2000:]))
                if not restart_exits or len(sup.exits) > max_exits:
                    raise AssertionError(
                        f"worker {w.name} exited with {rc} at progress {done}/{target}; incidents: "
                        f"{[(i.kind, i.worker, i.returncode, i.progress) for i in sup.incidents]}\n"
                        f"{sup.logs()}"
                    )
                sup.workers.append(make_worker(len(sup.workers)).start())
                continue
            if pending and done >= pending[0]:
                pending.pop(0)
                w.kill()  # SIGKILL: no shutdown hook, no final commit, no LeaveGroup
                sup.incidents.append(Incident("kill", w.name, now, done, w.proc.returncode))
                if on_kill is not None:
                    on_kill(sup.incidents[-1])
                sup.workers.append(make_worker(len(sup.workers)).start())
                continue
            if now > deadline_s:
                w.kill()
                raise AssertionError(
                    f"deadline {deadline_s:.0f}s: progress {done}/{target} after "
                    f"{[(i.kind, i.worker, i.returncode, i.progress) for i in sup.incidents]}\n"
                    f"{_diagnosis(diagnose)}{sup.logs()}")
            if tick is not None:
                tick(sup)
            time.sleep(poll_s)
    except BaseException:
        # The caller never gets ``sup`` back to stop the worker: a failed check in ``tick`` used to leave it
        # running until the test session's broker went away (nine minutes in one CI run).
        for w in sup.workers:
            w.kill()
        raise
    finally:
        sup.elapsed_s = time.monotonic() - t0
    return sup


def _diagnosis(diagnose: Callable[[], str] | None) -> str:
    if diagnose is None:
        return ""
    try:
        return f"{diagnose()}\n"
    except Exception as e:  # noqa: BLE001 - a failure message must not fail to be built
        return f"(diagnosis failed: {type(e).__name__}: {e})\n"


def where_things_stand(bootstrap: str, group: str, in_topic: str, out_topic: str,
                       watch: OutputWatcher | None = None) -> str:
    """The group's commits against the input's end offsets, the output's end offsets, and the watcher: whether
    the worker stopped short, its results did not reach the broker, or the reader fell behind."""
    parts = [f"input {in_topic}: committed {committed_offsets(bootstrap, group, in_topic, stable=False)} "
             f"of ends {end_offsets(bootstrap, in_topic)}",
             f"output {out_topic}: ends {end_offsets(bootstrap, out_topic)}"]
    if watch is not None:
        parts.append(watch.describe())
    return "; ".join(parts)


@dataclass
class Tally:
    sent: int
    results: int  # result records read (duplicates included)
    lost: int  # expected ids with no result
    duplicates: int  # result records beyond the first per id
    dlq: int
    by_id: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    dead_letters: list[Any] = field(default_factory=list)
    # Per id, in by_id's order: each result's output message timestamp (ms, the producer's clock when the
    # worker produced it), which tells the worker process that produced it apart from the others.
    stamps: dict[str, list[int]] = field(default_factory=dict)


def tally(bootstrap: str, out_topic: str, dlq_topic: str | None, expected: set[str], sent: int, *,
          read_committed: bool = True, idle: float = 3.0, timeout: float = 90.0) -> Tally:
    """A fresh read of the output (and DLQ) topic from the beginning."""
    msgs = read_all(bootstrap, out_topic, timeout=timeout, idle=idle, read_committed=read_committed)
    values = [_dec.decode(m.value()) for m in msgs]
    by_id: dict[str, list[dict[str, Any]]] = {}
    stamps: dict[str, list[int]] = {}
    for v, m in zip(values, msgs, strict=True):
        by_id.setdefault(v["id"], []).append(v)
        stamps.setdefault(v["id"], []).append(m.timestamp()[1])
    lost = sum(1 for i in expected if i not in by_id)
    dups = sum(len(v) - 1 for v in by_id.values())
    dead = read_all(bootstrap, dlq_topic, timeout=30, idle=2.0,
                    read_committed=read_committed) if dlq_topic else []
    return Tally(sent, len(values), lost, dups, len(dead), by_id, dead, stamps)


def _results_file() -> Path | None:
    """``KIW_CHAOS_RESULTS=path``: also append each report as a JSON line there (for the docs table)."""
    p = os.environ.get("KIW_CHAOS_RESULTS")
    return Path(p) if p else None


def report(name: str, t: Tally, **extra: Any) -> str:
    line = (f"[chaos:{name}] sent={t.sent} results={t.results} lost={t.lost} duplicates={t.duplicates} "
            f"dlq={t.dlq}")
    if extra:
        line += " " + " ".join(f"{k}={v}" for k, v in extra.items())
    print("\n" + line, flush=True)
    path = _results_file()
    if path is not None:
        with path.open("a") as f:
            f.write(json.dumps({"test": name, "sent": t.sent, "results": t.results, "lost": t.lost,
                                "duplicates": t.duplicates, "dlq": t.dlq, **extra, "at": time.time()}) + "\n")
    return line


def broker_healthy(bootstrap: str, timeout: float = 60.0) -> None:
    """Admin metadata answers with a broker, and every partition of the internal topics (consumer offsets,
    transaction state) has a leader. A new client per attempt: one created while a frozen broker resumed kept
    failing with "Broker transport failure" for the whole minute while the worker's own clients reconnected
    within 4 s (one CI run; the cause inside librdkafka was not found)."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            md = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0}).list_topics(timeout=5)
            if md.brokers:
                leaderless = [
                    f"{name}[{p.id}]"
                    for name in ("__consumer_offsets", "__transaction_state")
                    if name in md.topics
                    for p in md.topics[name].partitions.values()
                    if p.leader < 0
                ]
                if not leaderless:
                    return
                last = f"internal partitions without a leader: {leaderless[:4]}"
            else:
                last = "metadata without brokers"
        except Exception as e:  # noqa: BLE001 - retried until the deadline
            last = f"{type(e).__name__}: {e}"
        time.sleep(0.5)
    raise AssertionError(f"broker at {bootstrap} not healthy after {timeout:.0f}s: {last}")


def metrics_port(w: WorkerProcess, timeout: float = 60.0) -> int:
    """The port the worker's metrics server bound (metrics.port: 0), read from its log."""
    import re

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        m = re.search(r"metrics and health on port (\d+)", w.log())
        if m:
            return int(m.group(1))
        time.sleep(0.2)
    raise AssertionError(f"{w.name}: no 'metrics and health on port' line in the log:\n{w.log()[-3000:]}")


def scrape(port: int) -> dict[str, float]:
    """``/metrics`` as {'name{labels}': value}."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                pass
    return out


def wait_committed_to_end(bootstrap: str, group: str, topic: str, timeout: float = 60.0) -> dict[int, int]:
    """Waits until ``group``'s committed offsets equal ``topic``'s end offsets (no partition stopped short).
    Transient admin errors (coordinator loading or moved, e.g. just after a broker start) are retried."""
    ends = end_offsets(bootstrap, topic)
    seen: list[Any] = [None]

    def reached() -> bool:
        try:
            seen[0] = committed_offsets(bootstrap, group, topic)
        except KafkaException as e:
            seen[0] = f"{e}"
            return False
        return bool(seen[0] == ends)

    try:
        wait_for(reached, timeout, what="committed offsets to reach the end offsets")
    except AssertionError as e:
        raise AssertionError(f"{e}: end offsets {ends}, committed {seen[0]}") from None
    return ends
