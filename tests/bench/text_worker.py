"""One ``worker run`` over a corpus of texts through Kafka: the setup the text scenarios share (``realmodel``,
``gpu_feed``, ``scaleout``'s ``model.processes`` rows).

Each run gets fresh topics (``PARTITIONS`` input partitions, an output topic with broker append times) and a
fresh group. The worker starts first and the backlog is produced once every process owns partitions, so
start-up, group join and the rebalance that gives a later child its partitions stay out of the measurement.
(A backlog produced before the start is drained by the first child alone while the group rebalances, about
3 s.) The rate is the 5-95% window of the results' append times (``common.window_rate``); CPU by thread
class (``cpu_threads``, the broker's included) is sampled from then to the last result. The bench's
producer shares the cores while it sends the backlog, for every run alike.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import msgspec

from tests.bench.common import (
    Ctx,
    create_topics,
    produce_backlog,
    read_topic,
    start_worker,
    wait_count,
    window_rate,
    worker_config,
)
from tests.bench.cpu_threads import CpuProbe, per_record_us

PARTITIONS = 4
_enc = msgspec.json.Encoder()


def text_requests(corpus: list[str], prefix: str = "t") -> Iterator[tuple[bytes, bytes]]:
    """(key, JSON value) of one ``{"id", "inputs": {"text"}}`` request per text."""
    for i, t in enumerate(corpus):
        rid = f"{prefix}-{i}"
        yield rid.encode(), _enc.encode({"id": rid, "inputs": {"text": t}})


@dataclass
class TextRun:
    results: int
    rows: list[tuple[int, bytes]]  # (broker append time ms, value) of every result
    cpu_s: dict[str, float] = field(default_factory=dict)  # CPU seconds by thread class over the run

    def rate(self) -> float:
        """Results/s over the 5-95% window of their append times."""
        return window_rate([ts for ts, _ in self.rows])

    def cpu_us_per_record(self) -> dict[str, float]:
        return per_record_us({}, self.cpu_s, self.results)


def merge_sections(cfg: dict[str, Any], sections: dict[str, Any]) -> dict[str, Any]:
    """``cfg`` with each of ``sections`` (``{"model": {"host_threads": 1}}``) merged into its section."""
    for section, values in sections.items():
        cfg[section] = {**cfg.get(section, {}), **values}
    return cfg


def assignments(log_text: str) -> int:
    """How many "partitions assigned" lines with partitions in them the (JSON) log holds: a member that
    joins a busy group logs an empty assignment first, and gets its partitions one rebalance later."""
    return sum(1 for line in log_text.splitlines()
               if '"partitions assigned"' in line and '"partitions": []' not in line)


def wait_all_assigned(w: Any, processes: int, timeout: float = 300.0) -> None:
    """Until ``processes`` assignments with partitions are in the worker's log (children share it)."""
    deadline = time.monotonic() + timeout
    while assignments(w.log()) < processes:
        if not w.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{w.name}: {processes} process(es) never all got partitions:\n"
                               f"{w.log()[-3000:]}")
        time.sleep(0.05)


def run_texts(ctx: Ctx, tag: str, corpus: list[str], *, model: dict[str, Any], max_batch: int,
              batching: dict[str, Any] | None = None, sections: dict[str, Any] | None = None,
              timeout: float = 900.0) -> TextRun:
    """``corpus`` through one ``worker run`` (``model.processes`` children, if set in ``model`` or
    ``sections``). ``tag`` names the topics, group and log file."""
    r = f"{ctx.run}-{tag}"
    inp, out, dlq = f"{tag}-in-{r}", f"{tag}-out-{r}", f"{tag}-dlq-{r}"
    create_topics(ctx.bootstrap, {inp: PARTITIONS, out: PARTITIONS, dlq: 1}, log_append_time=[out])
    cfg = worker_config(ctx.bootstrap, f"{tag}-{r}", out, dlq, topics=[inp],
                        lanes=[{"name": "default", "max_batch_size": max_batch, "max_wait_ms": 10}],
                        model=model, batching=batching)
    merge_sections(cfg, sections or {})
    processes = int(cfg["model"].get("processes", 1))
    w = start_worker(f"{tag}-worker", cfg, ctx.work)
    try:
        wait_all_assigned(w, processes)
        if processes > 1:
            time.sleep(1.0)  # the cooperative rebalance moves partitions to the last one to join
        probe = CpuProbe(w.pid, ctx.bootstrap, supervised=processes > 1)
        before = probe.sample()
        produce_backlog(ctx.bootstrap, inp, text_requests(corpus), PARTITIONS)
        got = wait_count(ctx.bootstrap, out, len(corpus), timeout=timeout, alive=w.alive)
        after = probe.sample()
    finally:
        w.stop(60)
    cpu = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in set(before) | set(after)}
    return TextRun(got, read_topic(ctx.bootstrap, out, want=got), cpu)
