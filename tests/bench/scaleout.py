"""Issue 7.5 - scale-out: two worker processes in one consumer group against one, synthetic model.

Each run gets a fresh 4-partition topic and group. The workers start first and the backlog is produced only
once every one of them owns partitions (and the cooperative rebalance has settled), so group join and
rebalance stay out of the measurement; the rate is then taken over the 5-95% window of broker append times
of the results (see ``common``). The sleep-based model releases the GIL and needs little CPU, so two
processes on two cores can scale.
"""

from __future__ import annotations

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

PARTITIONS = 4


def _run(ctx: Ctx, workers: int, n: int) -> dict[str, Any]:
    r = f"{ctx.run}-x{workers}"
    inp, out = f"scale-in-{r}", f"scale-out-{r}"
    create_topics(ctx.bootstrap, {inp: PARTITIONS, out: PARTITIONS, f"scale-dlq-{r}": 1}, log_append_time=[out])
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


def run(ctx: Ctx) -> dict[str, Any]:
    seconds = 6.0 if ctx.quick else 12.0
    n1 = int(ideal(MAIN_B) * seconds)
    log(f"scale-out: synthetic B={MAIN_B}, {n1} records per worker")
    one = _run(ctx, 1, n1)
    two = _run(ctx, 2, 2 * n1)
    return {"one": one, "two": two, "rows": [
        row("7.5 scale-out", "2 processes, records/s", two["throughput_per_s"], "1 process",
            one["throughput_per_s"], ">=", 1.8, "rec/s", f"synthetic a=20 ms b=1 ms B={MAIN_B}, 4 partitions"),
    ]}
