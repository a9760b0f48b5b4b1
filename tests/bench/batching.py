"""Issue 3 (saturated throughput) and issue 7.2 - batching efficiency with the synthetic model.

The synthetic model costs ``a + b*n`` per batch (sleeps, releasing the GIL like a GPU wait), so the best any
batcher can do at max batch ``B`` is ``B / (a + b*B)`` records/s ("ideal"). For each ``B`` in the sweep one
worker process runs two phases on its own topic: a paced phase at 50% of that ideal (end-to-end latency
p50/p99 from ``timings.e2e_ms``), then a backlog (saturated throughput). At the main ``B`` the same backlog is
also run through the two seed batchers (``seed_batchers.py``: seed 000's ``DynamicBatcher``, seed 003's
``BatchInferenceServer``) at the same max batch and wait, and once more with host work in the model's
``collate`` (``host_ms`` per record, the GIL held, as a tokenizer) equal to its device time: the case where
overlapping the two (the worker collates batch n+1 while batch n is on the device) pays, up to 2x. Issue
3's latency at 10% load is measured with one lane at the main ``B`` and at ``LIGHT_B`` = 8, where 10% load
leaves the device idle between arrivals.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from tests.bench.common import (
    Ctx,
    KafkaFloor,
    Proc,
    create_topics,
    decode_results,
    log,
    percentile,
    produce_backlog,
    produce_paced,
    read_topic,
    row,
    start_worker,
    wait_assigned,
    wait_count,
    window_rate,
    worker_config,
)

A_MS, B_MS = 20.0, 1.0
MAIN_B = 32
LIGHT_B = 8  # the 10%-load check at a batch size where 10% load leaves the device idle between arrivals
WAIT_MS = 10.0
# Host work per record for the pipelining pass: per batch of MAIN_B it equals the device time a + b*B, so a
# batcher that overlaps them can be at most (host + device) / max(host, device) = 2x one that does not.
HOST_MS = (A_MS + B_MS * MAIN_B) / MAIN_B
PARTITIONS = 4


def ideal(bs: int) -> float:
    return bs / ((A_MS + B_MS * bs) / 1000.0)


def requests(prefix: str, n: int) -> Any:
    import msgspec

    enc = msgspec.json.Encoder()
    for i in range(n):
        rid = f"{prefix}-{i}"
        yield rid.encode(), enc.encode({"id": rid, "inputs": {"x": i}})


def synthetic_model(host_ms: float = 0.0) -> dict[str, Any]:
    return {"name": "synthetic", "options": {"a_ms": A_MS, "b_ms": B_MS, "host_ms": host_ms}, "warmup": False}


def _point(ctx: Ctx, bs: int, backlog: int, paced_s: float) -> dict[str, Any]:
    inp, out, w = _one_lane_worker(ctx, "batch", bs)
    try:
        wait_assigned(w)
        time.sleep(1.0)
        rate = 0.5 * ideal(bs)
        paced = produce_paced(ctx.bootstrap, ((inp, k, v) for k, v in requests("lat", 10**9)), rate, paced_s,
                              PARTITIONS)
        n_paced = len(paced.sent)
        wait_count(ctx.bootstrap, out, n_paced, timeout=120, alive=w.alive)
        produce_backlog(ctx.bootstrap, inp, requests("thr", backlog), PARTITIONS)
        wait_count(ctx.bootstrap, out, n_paced + backlog, timeout=600, alive=w.alive)
    finally:
        w.stop()
    rows = decode_results(read_topic(ctx.bootstrap, out, want=n_paced + backlog))
    lat = [d for _, d in rows if d["id"].startswith("lat-")]
    # Skip the first second of the paced phase (connections warming up).
    skip = int(rate * 1.0)
    e2e = [d["timings"]["e2e_ms"] for d in lat if int(d["id"].split("-")[1]) >= skip]
    thr_ts = [ts for ts, d in rows if d["id"].startswith("thr-")]
    thr_bs = [d["batch_size"] for _, d in rows if d["id"].startswith("thr-")]
    res = {"max_batch": bs, "ideal_per_s": ideal(bs), "batch_latency_ms": A_MS + B_MS * bs,
           "throughput_per_s": window_rate(thr_ts), "backlog": backlog,
           "mean_batch_saturated": sum(thr_bs) / max(len(thr_bs), 1),
           "paced_rate_per_s": rate, "paced_records": n_paced,
           "e2e_p50_ms": percentile(e2e, 50), "e2e_p99_ms": percentile(e2e, 99),
           "mean_batch_paced": sum(d["batch_size"] for d in lat) / max(len(lat), 1)}
    res["efficiency"] = res["throughput_per_s"] / res["ideal_per_s"]
    kept, _ = _ideal(paced, bs, paced.started * 1000 + 1000.0)
    res["ideal_wc_p50_ms"], res["ideal_wc_p99_ms"] = percentile(kept, 50), percentile(kept, 99)
    log(f"  B={bs}: {res['throughput_per_s']:.0f}/s of ideal {res['ideal_per_s']:.0f}/s "
        f"({res['efficiency']:.3f}); at 50% load p50 {res['e2e_p50_ms']:.1f} ms, p99 {res['e2e_p99_ms']:.1f} "
        f"ms (ideal work-conserving p99 {res['ideal_wc_p99_ms']:.1f} ms)")
    return res


def _light(ctx: Ctx, seconds: float, bs: int = MAIN_B) -> dict[str, Any]:
    """One lane at 10% of the ideal rate ``bs / (a + b*bs)`` (issue 3: work-conserving dispatch)."""
    inp, out, w = _one_lane_worker(ctx, "light", bs)
    rate = 0.1 * ideal(bs)
    floor = KafkaFloor(ctx.bootstrap, inp, PARTITIONS)
    floor.start()
    try:
        wait_assigned(w)
        time.sleep(1.0)
        paced = produce_paced(ctx.bootstrap, ((inp, k, v) for k, v in requests("light", 10**9)), rate,
                              seconds,
                              PARTITIONS)
        wait_count(ctx.bootstrap, out, len(paced.sent), timeout=120, alive=w.alive)
    finally:
        w.stop()
        floor_ms = floor.stop()
    rows = [d for _, d in decode_results(read_topic(ctx.bootstrap, out, want=len(paced.sent)))]
    t_from = paced.started * 1000 + 2000.0
    keep = [d for d in rows if paced.sent[d["id"]][1] >= t_from]
    e2e = [d["timings"]["e2e_ms"] for d in keep]
    sim_kept, sim_mean_batch = _ideal(paced, bs, t_from)
    floor_kept = [floor_ms[d["id"]] for d in keep if d["id"] in floor_ms]
    res = {"max_batch": bs, "rate_per_s": rate, "sent": len(paced.sent), "n": len(e2e),
           "e2e_p50_ms": percentile(e2e, 50),
           "e2e_p99_ms": percentile(e2e, 99),
           "mean_batch": sum(d["batch_size"] for d in keep) / max(len(keep), 1),
           "queue_p50_ms": percentile([d["timings"]["queue_ms"] for d in keep], 50),
           "inference_p50_ms": percentile([d["timings"]["inference_ms"] for d in keep], 50),
           "total_p50_ms": percentile([d["timings"]["total_ms"] for d in keep], 50),
           "ideal_wc_p50_ms": percentile(sim_kept, 50), "ideal_wc_p99_ms": percentile(sim_kept, 99),
           "kafka_floor_p50_ms": percentile(floor_kept, 50), "kafka_floor_p99_ms": percentile(floor_kept, 99),
           "total_p99_ms": percentile([d["timings"]["total_ms"] for d in keep], 99),
           "inference_p99_ms": percentile([d["timings"]["inference_ms"] for d in keep], 99),
           "queue_p99_ms": percentile([d["timings"]["queue_ms"] for d in keep], 99),
           "outside_worker_p99_ms": percentile([d["timings"]["e2e_ms"] - d["timings"]["total_ms"]
                                                for d in keep], 99),
           "ideal_mean_batch": sim_mean_batch, "e2e_ms": sorted(e2e)}
    log(f"  10% load, one lane, max batch {bs} ({rate:.1f}/s): p50 {res['e2e_p50_ms']:.1f} / p99 "
        f"{res['e2e_p99_ms']:.1f} ms (in the worker p99 {res['total_p99_ms']:.1f} ms; a bare consumer's "
        f"Kafka hop p50 {res['kafka_floor_p50_ms']:.1f} / p99 {res['kafka_floor_p99_ms']:.1f} ms), mean "
        f"batch {res['mean_batch']:.2f}; ideal work-conserving p50 {res['ideal_wc_p50_ms']:.1f} / p99 "
        f"{res['ideal_wc_p99_ms']:.1f} ms, mean batch {res['ideal_mean_batch']:.2f}")
    return res


def _one_lane_worker(ctx: Ctx, kind: str, bs: int, host_ms: float = 0.0) -> tuple[str, str, Proc]:
    """Input, output and DLQ topics plus a worker process with one lane of max batch ``bs``."""
    r = f"{ctx.run}-{kind}{bs}"
    inp, out, dlq = f"{kind}-in-{r}", f"{kind}-out-{r}", f"{kind}-dlq-{r}"
    create_topics(ctx.bootstrap, {inp: PARTITIONS, out: PARTITIONS, dlq: 1}, log_append_time=[out])
    cfg = worker_config(ctx.bootstrap, f"{kind}-{r}", out, dlq, topics=[inp],
                        lanes=[{"name": "default", "max_batch_size": bs, "max_wait_ms": WAIT_MS}],
                        model=synthetic_model(host_ms))
    return inp, out, start_worker(f"{kind}{bs}-worker", cfg, ctx.work)


def _ideal(paced: Any, bs: int, t_from: float) -> tuple[list[float], float]:
    """An ideal work-conserving batcher (``latency.simulate``, one queue) on the paced arrival times: the
    latencies of the records sent at or after ``t_from`` (ms), and its record-weighted mean batch size
    (records that complete together were one batch)."""
    from collections import Counter

    from tests.bench.latency import simulate

    arrivals = sorted((t, "low") for _tp, t in paced.sent.values())
    sim, done = simulate(arrivals, bs=bs, order=("low",))
    kept = [x for (t, _l), x in zip(arrivals, sim["low"], strict=True) if t >= t_from]
    sizes = Counter(done)
    return kept, sum(n * n for n in sizes.values()) / max(len(done), 1)


def _seed(ctx: Ctx, seed: str, inp: str, n: int, paced_s: float, host_ms: float = 0.0) -> dict[str, Any]:
    """One seed batcher: the shared backlog (throughput), then, unless ``paced_s`` is 0, paced requests at 50%
    of the ideal rate on its own topic (latency at the same load as the worker's paced phase)."""
    tag = f"seed{seed}" + ("-host" if host_ms else "")
    out = f"{tag}-out-{ctx.run}"
    paced_in = f"{tag}-paced-{ctx.run}"
    create_topics(ctx.bootstrap, {out: PARTITIONS, paced_in: PARTITIONS}, log_append_time=[out])
    p = Proc(tag, [sys.executable, "-m", "tests.bench.seed_batchers", "--seed", seed,
                   "--bootstrap", ctx.bootstrap, "--input", f"^({inp}|{paced_in})$", "--output", out,
                   "--group", f"{tag}-{ctx.run}", "--max-batch", str(MAIN_B), "--timeout-ms", str(WAIT_MS),
                   "--a-ms", str(A_MS), "--b-ms", str(B_MS), "--host-ms", str(host_ms)], ctx.work)
    rate = 0.5 * ideal(MAIN_B)
    n_paced = 0
    try:
        got = wait_count(ctx.bootstrap, out, n, timeout=900, alive=p.alive)
        total = got
        if paced_s > 0:
            paced = produce_paced(ctx.bootstrap, ((paced_in, k, v) for k, v in requests("lat", 10**9)), rate,
                                  paced_s, PARTITIONS)
            n_paced = len(paced.sent)
            # Seed 000 never runs a partial batch while records keep coming: the paced tail may need a while.
            total = wait_count(ctx.bootstrap, out, n + n_paced, timeout=120, alive=p.alive)
    finally:
        p.stop()
    rows = decode_results(read_topic(ctx.bootstrap, out, want=total))
    rate_thr = window_rate([ts for ts, d in rows if d["id"].startswith("thr-")])
    res: dict[str, Any] = {"results": got, "throughput_per_s": rate_thr, "host_ms": host_ms}
    if paced_s > 0:
        skip = int(rate * 1.0)
        e2e = [
            d["timings"]["e2e_ms"]
            for _, d in rows
            if d["id"].startswith("lat-")
            and int(d["id"].split("-")[1]) >= skip
            and d["timings"].get("e2e_ms")
        ]
        res.update({"paced_rate_per_s": rate, "paced_sent": n_paced, "paced_results": len(e2e),
                    "e2e_p50_ms": percentile(e2e, 50), "e2e_p99_ms": percentile(e2e, 99)})
        log(f"  seed {seed}: {got}/{n} results, {rate_thr:.0f}/s; at 50% load p50 {res['e2e_p50_ms']:.1f} "
            f"ms, p99 {res['e2e_p99_ms']:.1f} ms")
    else:
        log(f"  seed {seed}, host work {host_ms:g} ms per record: {got}/{n} results, {rate_thr:.0f}/s")
    return res


def _host_work(ctx: Ctx, n: int) -> dict[str, Any]:
    """The worker and both seeds on the same backlog, with ``HOST_MS`` of host work per record in collate."""
    inp, out, w = _one_lane_worker(ctx, "host", MAIN_B, host_ms=HOST_MS)
    try:
        wait_assigned(w)
        produce_backlog(ctx.bootstrap, inp, requests("thr", n), PARTITIONS)
        wait_count(ctx.bootstrap, out, n, timeout=600, alive=w.alive)
    finally:
        w.stop()
    rows = decode_results(read_topic(ctx.bootstrap, out, want=n))
    worker_rate = window_rate([ts for ts, _ in rows])
    log(f"  worker, host work {HOST_MS:g} ms per record: {worker_rate:.0f}/s "
        f"(mean batch {sum(d['batch_size'] for _, d in rows) / max(len(rows), 1):.1f})")
    seed_in = f"seed-host-in-{ctx.run}"
    create_topics(ctx.bootstrap, {seed_in: PARTITIONS})
    produce_backlog(ctx.bootstrap, seed_in, requests("thr", n), PARTITIONS)
    seeds = {s: _seed(ctx, s, seed_in, n, 0.0, host_ms=HOST_MS) for s in ("000", "003")}
    return {"host_ms": HOST_MS, "backlog": n, "worker_per_s": worker_rate,
            "ideal_pipelined_per_s": MAIN_B / (max(HOST_MS * MAIN_B, A_MS + B_MS * MAIN_B) / 1000.0),
            "ideal_serial_per_s": MAIN_B / ((HOST_MS * MAIN_B + A_MS + B_MS * MAIN_B) / 1000.0),
            "seeds": {s: r["throughput_per_s"] for s, r in seeds.items()}}


def run(ctx: Ctx) -> dict[str, Any]:
    sizes = [1, 8, 32] if ctx.quick else [1, 2, 4, 8, 16, 32, 64]
    main_backlog = 3000 if ctx.quick else 10_000
    paced_s = 3.0 if ctx.quick else 6.0
    sweep_s = 3.0 if ctx.quick else 6.0
    log(f"batching: synthetic a={A_MS:g} ms, b={B_MS:g} ms; sweep {sizes}")
    sweep = []
    for bs in sizes:
        backlog = main_backlog if bs == MAIN_B else max(200, int(ideal(bs) * sweep_s))
        sweep.append(_point(ctx, bs, backlog, paced_s))
    main = next(p for p in sweep if p["max_batch"] == MAIN_B)
    light = _light(ctx, 8.0 if ctx.quick else 15.0)
    # At B=32, 10% load (62/s) keeps the device busy: a record alone holds it for a + b = 21 ms, so records
    # queue behind each other and even an ideal batcher is at ~2x (a + b). At B=8 the same 10% (29/s) leaves
    # the device idle between arrivals: the situation the target describes.
    light8 = _light(ctx, 8.0 if ctx.quick else 45.0, bs=LIGHT_B)  # ~1,200 samples for a steadier p99
    # The seeds read the same kind of backlog from their own topic (their consumer groups start at 0).
    inp = f"seed-in-{ctx.run}"
    create_topics(ctx.bootstrap, {inp: PARTITIONS})
    produce_backlog(ctx.bootstrap, inp, requests("thr", main_backlog), PARTITIONS)
    seeds = {s: _seed(ctx, s, inp, main_backlog, paced_s) for s in ("000", "003")}
    host = _host_work(ctx, 1000 if ctx.quick else 3000)
    wr = main["throughput_per_s"]
    note = f"a={A_MS:g} ms, b={B_MS:g} ms, B={MAIN_B}, wait {WAIT_MS:g} ms, backlog {main_backlog}"
    rows = [
        row("3 / 7.2 saturated throughput", "worker records/s", wr, f"ideal B/(a+bB) = {ideal(MAIN_B):.0f}/s",
            ideal(MAIN_B), ">=", 0.95, "rec/s", note),
        row("7.2 batching vs seeds", "worker records/s", wr, "seed 000 DynamicBatcher",
            seeds["000"]["throughput_per_s"],
            ">=", 2.0, "rec/s", note),
        row("7.2 batching vs seeds", "worker records/s", wr, "seed 003 BatchInferenceServer",
            seeds["003"]["throughput_per_s"], ">=", 2.0, "rec/s", note),
        row("3 latency at 10% load", "p99 end-to-end ms", light["e2e_p99_ms"], f"a + b = {A_MS + B_MS:g} ms",
            A_MS + B_MS, "<=", 1.5, "ms", f"one lane, B={MAIN_B}; ideal work-conserving batcher on the same "
            f"arrivals: p99 {light['ideal_wc_p99_ms']:.1f} ms "
            f"({light['ideal_wc_p99_ms'] / (A_MS + B_MS):.2f}x); mean batch {light['mean_batch']:.2f} (ideal "
            f"{light['ideal_mean_batch']:.2f})"),
        row("3 latency at 10% load", "p99 end-to-end ms, B=8", light8["e2e_p99_ms"],
            f"a + b = {A_MS + B_MS:g} ms",
            A_MS + B_MS, "<=", 1.5, "ms", f"one lane, B={LIGHT_B}: 10% = {light8['rate_per_s']:.0f}/s, the "
            f"device idle between arrivals; ideal p99 {light8['ideal_wc_p99_ms']:.1f} ms; in the worker p99 "
            f"{light8['total_p99_ms']:.1f} ms (the model's own a + b sleep p99 "
            f"{light8['inference_p99_ms']:.1f} ms); a bare consumer's Kafka hop p99 "
            f"{light8['kafka_floor_p99_ms']:.1f} ms"),
    ]
    for s, name in (("000", "seed 000 DynamicBatcher"), ("003", "seed 003 BatchInferenceServer")):
        rows.append(row("7.2 batching vs seeds", "worker p99 end-to-end ms at 50% load", main["e2e_p99_ms"],
                        name, seeds[s]["e2e_p99_ms"], "info", 0, "ms",
                        f"same max batch and wait, {main['paced_rate_per_s']:.0f} requests/s evenly spaced; "
                        f"p50 worker {main['e2e_p50_ms']:.0f} ms, seed {seeds[s]['e2e_p50_ms']:.0f} ms"))
    bound = host["ideal_pipelined_per_s"] / host["ideal_serial_per_s"]  # (host + device) / max(host, device)
    for s, name in (("000", "seed 000 DynamicBatcher"), ("003", "seed 003 BatchInferenceServer")):
        rows.append(row("7.2 batching vs seeds, host work = device time", "worker records/s",
                        host["worker_per_s"],
                        name, host["seeds"][s], "info", 0, "rec/s",
                        f"{HOST_MS:g} ms of host work per record in collate (GIL held), {HOST_MS * MAIN_B:g} "
                        f"ms per batch of {MAIN_B} = its device time; a batcher that overlaps them can be at "
                        f"most {bound:.2f}x one that does not; worker at "
                        f"{host['worker_per_s'] / host['ideal_pipelined_per_s']:.2f} of the overlapped ideal "
                        f"{host['ideal_pipelined_per_s']:.0f}/s, backlog {host['backlog']}"))
    for s in ("000", "003"):
        seeds[s]["efficiency"] = seeds[s]["throughput_per_s"] / ideal(MAIN_B)
    return {"a_ms": A_MS, "b_ms": B_MS, "main_batch": MAIN_B, "max_wait_ms": WAIT_MS, "sweep": sweep,
            "seeds": seeds,
            "host_work": host,
            "light_load": light, "light_load_b8": light8, "rows": rows}

