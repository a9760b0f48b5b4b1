"""Issue 7.1 - pipeline overhead: the worker with the ``identity`` model against a raw confluent-kafka loop and
a Quix Streams application doing the same job on the same 100-byte JSON requests (4 partitions, a backlog
produced before each system starts; each reads it with its own consumer group and writes its own output
topic). Figure: results/s in the 5-95% window of broker append times (see ``common``). The raw loop runs
before and after the worker and the better run is the baseline (the machine is shared)."""

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
    outs = {k: f"pipe-out-{k}-{r}" for k in ("raw", "worker", "quix")}
    create_topics(ctx.bootstrap, {inp: PARTITIONS, f"pipe-dlq-{r}": 1, **dict.fromkeys(outs.values(), PARTITIONS)},
                  log_append_time=outs.values())
    log(f"pipeline: producing {n:,} x {VALUE_BYTES}-byte requests to {inp}")
    produce_backlog(ctx.bootstrap, inp, requests(n), PARTITIONS)
    res: dict[str, Any] = {"records": n, "value_bytes": VALUE_BYTES, "partitions": PARTITIONS}
    py = sys.executable

    def raw_loop(out: str, group: str) -> dict[str, Any]:
        p = Proc("raw-loop", [py, "-m", "tests.bench.raw_loop", "--bootstrap", ctx.bootstrap, "--input", inp,
                              "--output", out, "--group", group], ctx.work)
        return _measure(ctx, "raw confluent-kafka loop", p, out, n, "raw loop started")

    raw_runs = [raw_loop(outs["raw"], f"raw-{r}")]

    lane = {"name": "default", "max_batch_size": 256, "max_wait_ms": 5}
    cfg = worker_config(ctx.bootstrap, f"worker-{r}", outs["worker"], f"pipe-dlq-{r}", topics=[inp], lanes=[lane],
                        model={"name": "identity", "warmup": False}, metrics=True)
    # Metrics on, as `worker run` defaults: the figure is what a deployed worker does.
    res["worker_config"] = {"lane": lane, "metrics": True}
    w = start_worker("pipe-worker", cfg, ctx.work)
    res["worker"] = _measure(ctx, "worker (identity)", w, outs["worker"], n, "partitions assigned")
    # The raw loop again after the worker: the machine is shared, so the baseline is the better of the two.
    raw2 = f"pipe-out-raw2-{r}"
    create_topics(ctx.bootstrap, {raw2: PARTITIONS}, log_append_time=[raw2])
    raw_runs.append(raw_loop(raw2, f"raw2-{r}"))
    res["raw_runs"] = raw_runs
    res["raw"] = max(raw_runs, key=lambda x: x["records_per_s"])
    res["raw_cpu_us_per_record"] = min(x["cpu_us_per_record"] for x in raw_runs)

    quix = Proc("quix-app", [py, "-m", "tests.bench.quix_app", "--bootstrap", ctx.bootstrap, "--input", inp,
                             "--output", outs["quix"], "--group", f"quix-{r}", "--state-dir",
                             str(ctx.work / "quix-state")], ctx.work)
    res["quix"] = _measure(ctx, "Quix Streams app", quix, outs["quix"], n, "quix app started")

    wr = res["worker"]["records_per_s"]
    res["rows"] = [
        row("7.1 pipeline overhead", "worker records/s (identity, 100 B)", wr, "raw confluent-kafka loop",
            res["raw"]["records_per_s"], ">=", 0.8, "rec/s"),
        row("7.1 pipeline overhead", "worker records/s (identity, 100 B)", wr, "Quix Streams app",
            res["quix"]["records_per_s"], ">=", 1.5, "rec/s"),
        # CPU per record is far less sensitive to the other jobs on a shared machine than records/s.
        row("7.1 pipeline overhead", "worker CPU us per record", res["worker"]["cpu_us_per_record"],
            "raw loop CPU us per record", res["raw_cpu_us_per_record"], "info", 0, "us"),
        row("7.1 pipeline overhead", "worker CPU us per record", res["worker"]["cpu_us_per_record"],
            "Quix Streams CPU us per record", res["quix"]["cpu_us_per_record"], "info", 0, "us"),
    ]
    return res
