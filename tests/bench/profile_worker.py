"""Where the worker's CPU goes: the Runner in-process on a backlog, profiled across all its threads.

``python -m tests.bench.profile_worker [--tool yappi|pyinstrument|none] [--gc on|off|freeze]
[--model identity|synthetic] [--records N] [--max-batch B] [--top 30] [--metrics] [--producer K=V]
[--consumer K=V]`` prints per-thread CPU seconds and the functions with the most own CPU time (yappi,
CPU clock, so time spent waiting for the GIL or in sleep does not count), plus the records/s reached while
profiled. ``--tool cprofile`` profiles the loop thread with the standard library's cProfile. ``--tool none``
runs unprofiled and splits the process's CPU per record by OS thread (the loop thread, the device threads,
librdkafka's own), read from /proc. Needs ``yappi`` or ``pyinstrument`` (``pip install yappi pyinstrument``;
not project dependencies);
``--tool none`` needs neither (e.g. ``--tool none --gc freeze`` against ``--tool none --gc on``). Uses
$KAFKA_BOOTSTRAP_SERVERS or starts a local broker.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

from tests.bench.common import Broker, create_topics, produce_backlog, uid
from tests.bench.pipeline import requests


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="identity")
    ap.add_argument("--records", type=int, default=30_000)
    ap.add_argument("--max-batch", type=int, default=256)
    ap.add_argument("--max-wait-ms", type=float, default=5.0)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--metrics", action="store_true",
                    help="with the Prometheus metrics adapter (as `worker run`)")
    ap.add_argument(
        "--producer",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a librdkafka producer setting over the worker's defaults (repeatable), for A/B runs",
    )
    ap.add_argument("--consumer", action="append", default=[], metavar="KEY=VALUE",
                    help="a librdkafka consumer setting over the worker's defaults (repeatable)")
    ap.add_argument("--kafka-calls", action="store_true",
                    help="with --tool none: also the loop thread's CPU inside each Kafka client call "
                         "(producer.poll is where delivery reports are served)")
    ap.add_argument("--clock", default="cpu", choices=["cpu", "wall"])
    ap.add_argument("--tool", default="yappi", choices=["yappi", "pyinstrument", "cprofile", "none"],
                    help="yappi: every thread, CPU clock, deterministic (slow); pyinstrument: the loop "
                         "thread only, sampling (low overhead, truer proportions); none: just the records/s")
    ap.add_argument("--gc", default="on", choices=["on", "off", "freeze"],
                    help="Python's cyclic GC once the model is loaded: as is, disabled, or "
                         "gc.freeze() (A/B tests)")
    ap.add_argument("--mode", default="at_least_once", choices=["at_least_once", "exactly_once"],
                    help="delivery.mode (exactly_once: one transactional producer, a checkpoint "
                         "per commit interval)")
    ap.add_argument("--commit-interval-ms", type=int, default=1000,
                    help="kafka.commit_interval_ms (exactly_once: the transaction checkpoint interval)")
    args = ap.parse_args()

    from worker.config.settings import from_dict
    from worker.pipeline.runner import Runner

    with Broker() as b:
        r = uid()
        inp, out = f"prof-in-{r}", f"prof-out-{r}"
        create_topics(b.bootstrap, {inp: 4, out: 4, f"prof-dlq-{r}": 1})
        produce_backlog(b.bootstrap, inp, requests(args.records), 4)
        model: dict[str, Any] = {"name": args.model, "device": "cpu", "warmup": False}
        if args.model == "synthetic":
            model["options"] = {"a_ms": 20, "b_ms": 1}
        cfg = from_dict({
            "kafka": {"bootstrap_servers": b.bootstrap, "group_id": f"prof-{r}", "input_topics": [inp],
                      "output_topic": out, "dlq_topic": f"prof-dlq-{r}",
                      "commit_interval_ms": args.commit_interval_ms,
                      "producer": dict(kv.split("=", 1) for kv in args.producer),
                      "consumer": dict(kv.split("=", 1) for kv in args.consumer)},
            "model": model,
            "batching": {"lanes": [{"name": "default", "max_batch_size": args.max_batch,
                                    "max_wait_ms": args.max_wait_ms}]},
            "delivery": {"mode": args.mode},
            "metrics": {"enabled": False},
            "logging": {"level": "WARNING", "format": "text"},
        }, environ={})
        metrics = None
        if args.metrics:
            from worker.observability.metrics import PrometheusMetrics

            metrics = PrometheusMetrics()
        calls = _time_kafka_calls() if args.kafka_calls else None
        runner = Runner(cfg, metrics=metrics)
        if args.tool == "none":
            return _plain(runner, args.records, args.gc, calls)
        if args.tool == "pyinstrument":
            return _pyinstrument(runner, args.records)
        if args.tool == "cprofile":
            return _cprofile(runner, args.records, args.top)
        import yappi

        yappi.set_clock_type(args.clock)
        yappi.start(builtins=True, profile_threads=True)
        t = threading.Thread(target=runner.run, name="worker-loop", daemon=True)
        t.start()
        runner.ready.wait(120)
        st = runner.stats
        while st.records_in == 0:
            time.sleep(0.01)
        t0 = time.monotonic()
        while st.results_ok < args.records and t.is_alive():
            time.sleep(0.05)
        dt = time.monotonic() - t0
        yappi.stop()
        runner.stop()
        t.join(30)
        print(f"\n{st.results_ok} results in {dt:.2f}s = {st.results_ok / dt:,.0f} records/s (profiled, "
              f"mean batch {st.mean_batch:.1f})\n")
        print("CPU seconds per thread:")
        for th in sorted(yappi.get_thread_stats(), key=lambda x: -x.ttot):
            print(f"  {th.name:<28} {th.ttot:8.3f}")
        stats = yappi.get_func_stats()
        stats.sort("tsub", "desc")
        print(f"\ntop {args.top} functions by own time (tsub), all threads:")
        print(f"  {'ncall':>9} {'tsub':>8} {'ttot':>8}  function")
        for s in list(stats)[: args.top]:
            print(f"  {s.ncall:>9} {s.tsub:8.3f} {s.ttot:8.3f}  "
                  f"{s.module.split('site-packages/')[-1]}:{s.lineno} {s.name}")
    return 0


def _cprofile(runner: Any, records: int, top: int) -> int:
    """The loop thread alone under the standard library's cProfile (deterministic: every call is counted,
    which inflates small functions; compare functions with each other, not with unprofiled figures)."""
    import cProfile
    import pstats

    prof = cProfile.Profile(time.thread_time)

    def run() -> None:
        prof.enable()
        try:
            runner.run()
        finally:
            prof.disable()

    t = threading.Thread(target=run, name="worker-loop", daemon=True)
    t.start()
    runner.ready.wait(120)
    st = runner.stats
    while st.results_ok < records and t.is_alive():
        time.sleep(0.05)
    runner.stop()
    t.join(30)
    n = max(st.results_ok, 1)
    ps = pstats.Stats(prof)
    rows = sorted(ps.stats.items(), key=lambda kv: -kv[1][2])  # type: ignore[attr-defined]
    total = sum(v[2] for _, v in rows)
    print(f"\n{st.results_ok} results; loop thread, own CPU time per function (cProfile, thread CPU clock): "
          f"{total / n * 1e6:.2f} us per record in all\n")
    print(f"  {'calls/rec':>9} {'us/rec':>7}  function")
    for (file, line, name), (_cc, nc, tt, _ct, _callers) in rows[:top]:
        where = file.split("site-packages/")[-1].split("wt-hotpath/")[-1]
        print(f"  {nc / n:9.3f} {tt / n * 1e6:7.3f}  {where}:{line} {name}")
    return 0


def _plain(runner: Any, records: int, gc_mode: str, calls: dict[str, list[float]] | None = None) -> int:
    import gc

    t = threading.Thread(target=runner.run, name="worker-loop", daemon=True)
    t.start()
    runner.ready.wait(120)
    if gc_mode == "off":
        gc.disable()
    elif gc_mode == "freeze":
        gc.freeze()  # everything allocated so far (torch, the model) leaves the collector's generations
    st = runner.stats
    while st.records_in == 0:
        time.sleep(0.001)
    if calls is not None:
        calls.clear()  # start-up (group join, metadata) is not the steady state
    t0, c0, th0 = time.monotonic(), time.process_time(), _thread_cpu()
    while st.results_ok < records and t.is_alive():
        time.sleep(0.01)
    dt, cpu, th1 = time.monotonic() - t0, time.process_time() - c0, _thread_cpu()
    runner.stop()
    t.join(30)
    # Process CPU per record (all threads, librdkafka's included) is the steadier figure on a shared machine.
    print(f"gc={gc_mode}: {st.results_ok} results in {dt:.2f}s = {st.results_ok / dt:,.0f} records/s, "
          f"{cpu / max(st.results_ok, 1) * 1e6:.1f} us CPU per record "
          f"(mean batch {st.mean_batch:.1f}, objects frozen {gc.get_freeze_count()})")
    n = max(st.results_ok, 1)
    print("CPU per record by OS thread (Python threads by name, librdkafka's by theirs):")
    for name in sorted(th1, key=lambda k: -(th1[k] - th0.get(k, 0.0))):
        us = (th1[name] - th0.get(name, 0.0)) / n * 1e6
        if us >= 0.05:
            print(f"  {name:<32} {us:6.2f} us")
    if calls is not None:
        print("loop thread inside Kafka client calls, per record: CPU, and wall time (waits included)")
        for name, (secs, count, wall) in sorted(calls.items(), key=lambda kv: -kv[1][0]):
            print(
                f"  {name:<32} {secs / n * 1e6:6.2f} us  wall {wall / n * 1e6:6.2f} us  ({count:.0f} calls)"
            )
    return 0


def _time_kafka_calls() -> dict[str, list[float]]:
    """Wrap the runner's Kafka clients so each call's thread CPU time and wall time are summed per method
    (from the moment the steady state starts; see _plain). A wrapper call costs well under a microsecond, and
    poll/consume are called once per loop turn, produce once per record."""
    import worker.pipeline.runner

    acc: dict[str, list[float]] = {}
    timed = {"poll", "consume", "produce", "commit", "store_offsets", "pause", "resume"}

    class Timed:
        def __init__(self, inner: Any, kind: str) -> None:
            self._inner, self._kind = inner, kind

        def __len__(self) -> int:  # the emitter's drain check (not timed: a C call of ~0.1 us)
            return len(self._inner)

        def __getattr__(self, name: str) -> Any:
            f = getattr(self._inner, name)
            if name not in timed:
                return f
            slot = acc.setdefault(f"{self._kind}.{name}", [0.0, 0, 0.0])

            def call(*a: Any, **k: Any) -> Any:
                t, w = time.thread_time(), time.perf_counter()
                try:
                    return f(*a, **k)
                finally:
                    slot[0] += time.thread_time() - t
                    slot[1] += 1
                    slot[2] += time.perf_counter() - w  # with the waits: a poll timeout, the GIL taken back
            return call

    make_consumer, make_producer = worker.pipeline.runner.make_consumer, worker.pipeline.runner.make_producer
    worker.pipeline.runner.make_consumer = lambda *a, **k: Timed(make_consumer(*a, **k), "consumer")  # type: ignore[assignment]
    worker.pipeline.runner.make_producer = lambda *a, **k: Timed(make_producer(*a, **k), "producer")  # type: ignore[assignment]
    return acc


def _thread_cpu() -> dict[str, float]:
    """CPU seconds per OS thread of this process (Linux /proc), keyed by the Python thread's name where the
    thread is a Python one, else by its OS name (librdkafka names its threads rdk:main, rdk:broker1 ...)."""
    import os

    names = {th.native_id: th.name for th in threading.enumerate()}
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1: stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        name = names.get(int(tid)) or f"{comm} [{tid}]"
        out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def _pyinstrument(runner: Any, records: int) -> int:
    """The loop thread (where the Kafka calls, decode, routing and result encoding run) is the caller of
    ``run``: profile it in the main thread, stop it from a watcher thread."""
    from pyinstrument import Profiler

    times: dict[str, float] = {}

    def watch() -> None:
        st = runner.stats
        while st.records_in == 0:
            time.sleep(0.01)
        times["t0"] = time.monotonic()
        while st.results_ok < records:
            time.sleep(0.05)
        times["t1"] = time.monotonic()
        runner.stop()

    threading.Thread(target=watch, daemon=True).start()
    prof = Profiler(interval=0.0005)
    prof.start()
    runner.run()
    prof.stop()
    dt = times["t1"] - times["t0"]
    print(f"\n{runner.stats.results_ok} results in {dt:.2f}s = {runner.stats.results_ok / dt:,.0f} records/s "
          f"(profiled, mean batch {runner.stats.mean_batch:.1f})\n")
    print(prof.output_text(unicode=False, color=False, show_all=False))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
