"""Issue 7.5 - scale-out: two worker processes in one consumer group against one, synthetic model; and
issue 27.4 - ``model.processes: 2`` (one supervisor, two children) against one process on the null-device
MiniLM handler (``null_device.py``: real tokenizing, collating and splitting, a forward that costs nothing),
whose host work is what bounds it.

Each run gets a fresh 4-partition topic and group. The workers start first and the backlog is produced only
once every one of them owns partitions (and the cooperative rebalance has settled), so group join and
rebalance stay out of the measurement; the rate is then taken over the 5-95% window of broker append times
of the results (see ``common``). The sleep-based model releases the GIL and needs little CPU, so two
processes on two cores can scale.

The null-device row needs CPU, not a device: 60-80 us of worker CPU per text and 15-20 us of the broker's
(``gpu_feed``'s rows by thread), so one process at full speed keeps more than the two cores of the
development machine busy, and two processes can only share them. The row measures the supervisor where
the cores free for the workers exceed what one process keeps busy (its rate times its CPU per record, in
the row's note), about twice as many for 1.8x; see docs/design-notes.md, "gpu_feed: the right ceiling on
shared cores". The row prints the workers' CPU per record and the cores they used, the figures that show
what bounded a run. The null-device runs use ``text_worker.run_texts`` (the setup ``gpu_feed`` and
``realmodel`` share).
"""

from __future__ import annotations

import os
import time
from typing import Any

from tests.bench.batching import MAIN_B, WAIT_MS, ideal, requests, synthetic_model
from tests.bench.common import (
    Ctx,
    create_topics,
    log,
    produce_backlog,
    read_topic,
    row,
    start_worker,
    wait_assigned,
    wait_count,
    window_rate,
    worker_config,
)
from tests.bench.realmodel import texts
from tests.bench.text_worker import run_texts

PARTITIONS = 4


def _run(ctx: Ctx, workers: int, n: int) -> dict[str, Any]:
    r = f"{ctx.run}-x{workers}"
    inp, out = f"scale-in-{r}", f"scale-out-{r}"
    create_topics(ctx.bootstrap, {inp: PARTITIONS, out: PARTITIONS, f"scale-dlq-{r}": 1},
                  log_append_time=[out])
    cfg = worker_config(ctx.bootstrap, f"scale-{r}", out, f"scale-dlq-{r}", topics=[inp],
                        lanes=[{"name": "default", "max_batch_size": MAIN_B, "max_wait_ms": WAIT_MS}],
                        model=synthetic_model())
    procs = []
    try:
        for i in range(workers):
            procs.append(start_worker(f"scale-x{workers}-{i}", cfg, ctx.work))
        for p in procs:
            wait_assigned(p)
        time.sleep(3.0)  # let the cooperative rebalance finish moving partitions to the last one
        produce_backlog(ctx.bootstrap, inp, requests("s", n), PARTITIONS)
        got = wait_count(ctx.bootstrap, out, n, timeout=600, alive=lambda: all(p.alive() for p in procs))
    finally:
        for p in procs:
            p.stop()
    rate = window_rate([ts for ts, _ in read_topic(ctx.bootstrap, out, want=got)])
    owners = [p.log().count("partitions assigned") for p in procs]
    log(f"  {workers} worker(s): {got}/{n} results, {rate:.0f}/s")
    return {"workers": workers, "records": n, "results": got, "throughput_per_s": rate, "assignments": owners}


NULL_MODEL = {"name": "tests.bench.null_device:null_minilm", "warmup": False}
NULL_B = 256


def _run_processes(ctx: Ctx, processes: int, corpus: list[str]) -> dict[str, Any]:
    """One ``worker run`` with ``model.processes`` = ``processes`` draining ``corpus`` on the null device.

    The backlog is produced once every child owns partitions (``text_worker.run_texts``)."""
    res = run_texts(ctx, f"procs-p{processes}", corpus, model={**NULL_MODEL, "processes": processes},
                    max_batch=NULL_B, timeout=600)
    rate = res.rate()
    cpu = res.cpu_us_per_record()
    # The cores the worker processes keep busy at the measured rate (their CPU per record times the rate).
    cores = cpu["total"] * 1e-6 * rate
    log(f"  null-device minilm, model.processes={processes}: {res.results}/{len(corpus)} results, "
        f"{rate:.0f}/s; workers' CPU {cpu['total']:.0f} us/record, "
        f"{cores:.2f} cores at that rate, broker {cpu.get('broker', float('nan')):.0f} us/record; "
        f"load average {os.getloadavg()[0]:.1f}")
    return {"processes": processes, "records": len(corpus), "results": res.results,
            "throughput_per_s": rate, "cpu_us_per_record": cpu["total"], "cpu_by_thread": cpu,
            "cores_used": cores, "load_average_1m": os.getloadavg()[0]}


def run(ctx: Ctx) -> dict[str, Any]:
    seconds = 6.0 if ctx.quick else 12.0
    n1 = int(ideal(MAIN_B) * seconds)
    log(f"scale-out: synthetic B={MAIN_B}, {n1} records per worker")
    one = _run(ctx, 1, n1)
    two = _run(ctx, 2, 2 * n1)
    n_null = 8000 if ctx.quick else 30000
    log(f"scale-out: null-device minilm B={NULL_B}, {n_null} texts per process")
    p1 = _run_processes(ctx, 1, texts(n_null))
    p2 = _run_processes(ctx, 2, texts(2 * n_null))
    return {"one": one, "two": two, "null_one": p1, "null_two": p2, "rows": [
        row("7.5 scale-out", "2 processes, records/s", two["throughput_per_s"], "1 process",
            one["throughput_per_s"], ">=", 1.8, "rec/s",
            f"synthetic a=20 ms b=1 ms B={MAIN_B}, 4 partitions"),
        row("27.4 processes", "model.processes 2, texts/s", p2["throughput_per_s"], "model.processes 1",
            p1["throughput_per_s"], ">=", 1.8, "texts/s",
            f"null-device minilm B={NULL_B}, 4 partitions, {os.cpu_count()} cores; workers' CPU "
            f"{p1['cpu_us_per_record']:.0f} / {p2['cpu_us_per_record']:.0f} us/record, "
            f"{p1['cores_used']:.2f} / {p2['cores_used']:.2f} cores"),
    ]}
