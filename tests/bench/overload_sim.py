"""The latency bench's overload step replayed on the real scheduler, without Kafka, threads or a clock.

``python -m tests.bench.overload_sim [--load 2.0[,0.9,...]] [--high-wait-ms 5,10,20,30,50] [--seconds 60] [--fill]
[--high-max-batch 32]`` prints, per load and high-lane ``max_wait_ms``, the records/s served (as a fraction of
full-batch capacity), the mean size and share of device time of the batches the high lane leads, the p99
latency of each lane and the low lane's share of the records served. ``--fill`` sets ``fill_with_lower`` on
the high lane (its partial batches take low-lane records into their free slots).

What it models: the two lanes of ``tests.bench.latency`` (high: priority 1, weight 4, 10% of the traffic;
low: priority 0, weight 1), Poisson arrivals, one device whose batch of ``n`` takes ``a + b*n`` (the synthetic
model), and the runner's dispatch rules: while the device is busy the collate stage takes a batch ahead only
if it is full (``next_batch(idle=False, full_only=True)``); when the device frees up a higher lane's closed
batch may take its place (``preempt``), else a partial batch taken ahead takes along what arrived since
(``top_up``); with none taken ahead, a free device takes the best batch, open windows included
(``next_batch(idle=True)``). Records over a lane's ``queue_bound`` wait "in Kafka" (the runner pauses the
lane's partitions) and enter when the lane drops below it; their latency counts from arrival.

Why: the bench's overload figures (0.44-0.46 of capacity served at a 10 ms high-lane window, 0.80-0.81 at 30 ms) take
minutes on a noisy machine. This reproduces them within a few hundredths in a second, deterministically, so a
scheduler change that alters them shows up in the unit tests (``tests/unit/test_overload_sim.py``).
"""

from __future__ import annotations

import argparse
import random
from collections import deque
from dataclasses import dataclass

from tests.bench.batching import A_MS, B_MS
from tests.bench.latency import HIGH_SHARE, MAX_B, W_HIGH, W_LOW
from worker.config import LaneConfig
from worker.core.records import Record, TopicPartition
from worker.core.scheduler import PriorityScheduler

QUEUE_BOUND = 2000  # the latency bench's per-lane queue_bound
CAPACITY = MAX_B / ((A_MS + B_MS * MAX_B) / 1000.0)  # records/s with every batch full


@dataclass
class Outcome:
    served_per_s: float
    capacity_fraction: float
    high_mean_batch: float
    high_device_share: float
    high_p99_ms: float
    low_share: float
    low_p99_ms: float


def lanes(high_wait_ms: float, fill: bool = False, high_max: int = MAX_B) -> list[LaneConfig]:
    return [
        LaneConfig(name="high", priority=1, weight=W_HIGH, max_batch_size=high_max, max_wait_ms=high_wait_ms,
                   queue_bound=QUEUE_BOUND, fill_with_lower=fill),
        LaneConfig(name="low", priority=0, weight=W_LOW, max_batch_size=MAX_B, max_wait_ms=10,
                   queue_bound=QUEUE_BOUND),
    ]


def simulate(high_wait_ms: float, load: float = 2.0, seconds: float = 60.0, seed: int = 1,
             fill: bool = False, high_max: int = MAX_B) -> Outcome:
    rng = random.Random(seed)
    sched = PriorityScheduler(lanes(high_wait_ms, fill, high_max), "low")
    a_s, b_s = A_MS / 1000.0, B_MS / 1000.0
    arrivals: list[tuple[float, str]] = []
    t = 0.0
    while True:
        t += rng.expovariate(load * CAPACITY)
        if t >= seconds:
            break
        arrivals.append((t, "high" if rng.random() < HIGH_SHARE else "low"))
    tp = TopicPartition("sim", 0)
    in_kafka: dict[str, deque[Record]] = {"high": deque(), "low": deque()}
    served = {"high": 0, "low": 0}
    busy = {"high": 0.0, "low": 0.0}
    batches = {"high": 0, "low": 0}
    high_lat: list[float] = []
    low_lat: list[float] = []
    high_batch_records = 0
    now, i = 0.0, 0
    while now < seconds:
        for lane, waiting in in_kafka.items():  # room again: paused partitions resume
            while waiting and sched.queued(lane) < QUEUE_BOUND:
                sched.add(waiting.popleft(), now)
        while i < len(arrivals) and arrivals[i][0] <= now:
            at, lane = arrivals[i]
            rec = Record(tp, i, b"", received_at=at)
            rec.lane = lane
            # The runner's loop thread admits records as they arrive, while the device works: a record that
            # finds room enters at its arrival time (its window's max_wait runs from there).
            if in_kafka[lane] or sched.queued(lane) >= QUEUE_BOUND:
                in_kafka[lane].append(rec)
            else:
                sched.add(rec, at)
            i += 1
        # The batch taken ahead while the device was busy (full only), unless a higher lane's closed batch
        # preempts it (a partial one is topped up); with none taken ahead, the free device takes the best,
        # open windows included.
        ahead = sched.next_batch(now, idle=False, full_only=True) if now > 0 else None
        if ahead is not None:
            # As Runner._swap: start (the batch no longer counts as its lane's waiting work), preempt, top_up.
            sched.start(ahead)
            batch = sched.preempt(ahead, now) or sched.top_up(ahead, now) or ahead
        else:
            batch = sched.next_batch(now, idle=True)
        if batch is None or not batch.records:
            nxt = arrivals[i][0] if i < len(arrivals) else seconds
            wake = sched.next_wakeup(now)
            now = min(nxt, wake) if wake is not None and wake > now else nxt
            continue
        took = a_s + b_s * len(batch.records)
        now += took
        for r in batch.records:
            served[r.lane] += 1
            (high_lat if r.lane == "high" else low_lat).append(now - r.received_at)
        busy[batch.lane] += took
        batches[batch.lane] += 1
        if batch.lane == "high":
            high_batch_records += len(batch.records)
    total = served["high"] + served["low"]
    high_lat.sort()
    low_lat.sort()
    return Outcome(
        served_per_s=total / seconds,
        capacity_fraction=total / seconds / CAPACITY,
        high_mean_batch=high_batch_records / max(batches["high"], 1),
        high_device_share=busy["high"] / seconds,
        high_p99_ms=high_lat[int(0.99 * (len(high_lat) - 1))] * 1000.0 if high_lat else float("nan"),
        low_share=served["low"] / max(total, 1),
        low_p99_ms=low_lat[int(0.99 * (len(low_lat) - 1))] * 1000.0 if low_lat else float("nan"),
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--load", default="2.0",
                    help="offered load / capacity; several, comma-separated, give a row each (default 2.0)")
    ap.add_argument("--high-wait-ms", default="5,10,20,30,50", help="high-lane max_wait_ms values to compare")
    ap.add_argument("--fill", action="store_true", help="the high lane with fill_with_lower: true")
    ap.add_argument("--high-max-batch", type=int, default=MAX_B,
                    help=f"the high lane's max_batch_size (default {MAX_B}, the low lane's): with --fill it bounds "
                         "how long a filled high batch takes")
    ap.add_argument("--seconds", type=float, default=60.0, help="simulated seconds per value (default 60)")
    args = ap.parse_args()
    try:
        loads = [float(x) for x in args.load.split(",")]
        waits = [float(x) for x in args.high_wait_ms.split(",")]
    except ValueError as e:
        ap.error(f"--load and --high-wait-ms take comma-separated numbers: {e}")
    if any(x <= 0 for x in loads) or any(x < 0 for x in waits):
        ap.error("--load values must be > 0 and --high-wait-ms values >= 0")
    if args.high_max_batch < 1:
        ap.error("--high-max-batch must be >= 1")
    print(f"a={A_MS} ms, b={B_MS} ms, max batch {MAX_B}: capacity {CAPACITY:.0f} records/s; high lane "
          f"{HIGH_SHARE:.0%} of the traffic, weights high {W_HIGH:g} / low {W_LOW:g}"
          f"{', fill_with_lower' if args.fill else ''}, high max batch {args.high_max_batch}")
    print(f"{'load':>5} {'high max_wait':>14} {'served/s':>9} {'of capacity':>12} {'high batch':>11} "
          f"{'high device':>12} {'high p99 ms':>12} {'low p99 ms':>11} {'low share':>10}")
    for load in loads:
        for w in waits:
            o = simulate(w, load, args.seconds, fill=args.fill, high_max=args.high_max_batch)
            print(f"{load:>5.0%} {w:>11.0f} ms {o.served_per_s:>9.0f} {o.capacity_fraction:>12.2f} "
                  f"{o.high_mean_batch:>11.1f} {o.high_device_share:>12.2f} {o.high_p99_ms:>12.0f} "
                  f"{o.low_p99_ms:>11.0f} {o.low_share:>10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
