"""Issue 7.1 - pipeline overhead: the worker with the ``identity`` model against a raw confluent-kafka loop and
a Quix Streams application doing the same job on the same 100-byte JSON requests (4 partitions, a backlog
produced before each system starts; each reads it with its own consumer group and writes its own output
topic). Figure: results/s in the 5-95% window of broker append times (see ``common``). The machine is shared
and one run of a system can be 1.5x another's, so the three run in turn (raw loop, worker, Quix), ``ROUNDS``
times each, and every system's figure is its best run (all runs are kept)."""

from __future__ import annotations

import sys
from typing import Any

from tests.bench.common import (
    Ctx,
    Proc,
    cpu_s,
    create_topics,
    end_count,
    log,
    produce_backlog,
    read_topic,
    row,
    start_worker,
    wait_count,
    window_rate,
    worker_config,
)

PARTITIONS = 4
VALUE_BYTES = 100
ROUNDS = 3  # runs of each system (1 with --quick)


def requests(n: int) -> Any:
    import msgspec

    enc = msgspec.json.Encoder()
    for i in range(n):
        rid = f"p-{i}"
        body = {"id": rid, "inputs": {"v": i, "pad": ""}}
        pad = VALUE_BYTES - len(enc.encode(body))
        body["inputs"]["pad"] = "x" * max(pad, 0)  # type: ignore[index]
        yield rid.encode(), enc.encode(body)


def _measure(ctx: Ctx, name: str, proc: Proc, out: str, n: int, ready: str) -> dict[str, Any]:
    """Throughput from the results' append times; CPU per record of the whole process (all threads) from the
    moment it logged ``ready`` to the last result (the few records done before that moment are subtracted)."""
    proc.wait_for_log(ready)
    cpu0, done0 = cpu_s(proc.pid), end_count(ctx.bootstrap, out)
    got = wait_count(ctx.bootstrap, out, n, timeout=600, alive=proc.alive, every=0.1)
    cpu1 = cpu_s(proc.pid)
    proc.stop()
    ts = [t for t, _ in read_topic(ctx.bootstrap, out, want=got)]
    rate = window_rate(ts)
    cpu_us = (cpu1 - cpu0) / max(got - done0, 1) * 1e6
    log(f"  {name}: {got}/{n} results, {rate:,.0f} records/s, {cpu_us:.0f} us CPU per record")
    return {"records": n, "results": got, "records_per_s": rate, "cpu_us_per_record": cpu_us}


def run(ctx: Ctx) -> dict[str, Any]:
    n = 30_000 if ctx.quick else 200_000
    r = ctx.run
    inp = f"pipe-in-{r}"
    create_topics(ctx.bootstrap, {inp: PARTITIONS, f"pipe-dlq-{r}": 1})
    log(f"pipeline: producing {n:,} x {VALUE_BYTES}-byte requests to {inp}")
    produce_backlog(ctx.bootstrap, inp, requests(n), PARTITIONS)
    res: dict[str, Any] = {"records": n, "value_bytes": VALUE_BYTES, "partitions": PARTITIONS}
    py = sys.executable

    def fresh_out(name: str) -> str:
        """Every run writes its own output topic: its broker append times are the figure."""
        create_topics(ctx.bootstrap, {name: PARTITIONS}, log_append_time=[name])
        return name

    def raw_loop(i: int) -> dict[str, Any]:
        out, group = fresh_out(f"pipe-out-raw{i}-{r}"), f"raw{i}-{r}"
        p = Proc("raw-loop", [py, "-m", "tests.bench.raw_loop", "--bootstrap", ctx.bootstrap, "--input", inp,
                              "--output", out, "--group", group], ctx.work)
        return _measure(ctx, "raw confluent-kafka loop", p, out, n, "raw loop started")

    lane = {"name": "default", "max_batch_size": 256, "max_wait_ms": 5}
    # Metrics on, as `worker run` defaults: the figure is what a deployed worker does.
    res["worker_config"] = {"lane": lane, "metrics": True}

    def worker(i: int) -> dict[str, Any]:
        out = fresh_out(f"pipe-out-worker{i}-{r}")
        cfg = worker_config(ctx.bootstrap, f"worker{i}-{r}", out, f"pipe-dlq-{r}", topics=[inp], lanes=[lane],
                            model={"name": "identity", "warmup": False}, metrics=True)
        return _measure(ctx, "worker (identity)", start_worker(f"pipe-worker{i}", cfg, ctx.work), out, n,
                        "partitions assigned")

    def quix(i: int) -> dict[str, Any]:
        out = fresh_out(f"pipe-out-quix{i}-{r}")
        p = Proc(f"quix-app{i}", [py, "-m", "tests.bench.quix_app", "--bootstrap", ctx.bootstrap, "--input", inp,
                                  "--output", out, "--group", f"quix{i}-{r}", "--state-dir",
                                  str(ctx.work / f"quix-state{i}")], ctx.work)
        return _measure(ctx, "Quix Streams app", p, out, n, "quix app started")

    # Rounds of the three, alternating, the same number of runs each: each system's best run counts.
    raw_runs: list[dict[str, Any]] = []
    worker_runs: list[dict[str, Any]] = []
    quix_runs: list[dict[str, Any]] = []
    for i in range(1 if ctx.quick else ROUNDS):
        raw_runs.append(raw_loop(i))
        worker_runs.append(worker(i))
        quix_runs.append(quix(i))
    for name, runs in (("raw", raw_runs), ("worker", worker_runs), ("quix", quix_runs)):
        res[f"{name}_runs"] = runs
        res[name] = max(runs, key=lambda x: x["records_per_s"])
    cpu = {name: min(x["cpu_us_per_record"] for x in res[f"{name}_runs"]) for name in ("raw", "worker", "quix")}
    res["raw_cpu_us_per_record"] = cpu["raw"]

    def runs(name: str) -> str:
        return f"{name} runs: " + ", ".join(f"{x['records_per_s']:,.0f}" for x in res[f"{name}_runs"]) + "/s"

    wr = res["worker"]["records_per_s"]
    res["rows"] = [
        row("7.1 pipeline overhead", "worker records/s (identity, 100 B)", wr, "raw confluent-kafka loop",
            res["raw"]["records_per_s"], ">=", 0.8, "rec/s", f"best runs; {runs('worker')}, {runs('raw')}"),
        row("7.1 pipeline overhead", "worker records/s (identity, 100 B)", wr, "Quix Streams app",
            res["quix"]["records_per_s"], ">=", 1.5, "rec/s", f"best runs; {runs('quix')}"),
        # CPU per record is far less sensitive to the other jobs on a shared machine than records/s.
        row("7.1 pipeline overhead", "worker CPU us per record", cpu["worker"],
            "raw loop CPU us per record", cpu["raw"], "info", 0, "us", "lowest of the runs"),
        row("7.1 pipeline overhead", "worker CPU us per record", cpu["worker"],
            "Quix Streams CPU us per record", cpu["quix"], "info", 0, "us", "lowest of the runs"),
    ]
    return res
