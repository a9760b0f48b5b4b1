"""Issue 28 item 5: continuous (iteration-level) vs static batching of a generative model, same arrivals.

Model: ``synthetic-lm``, a decode step costs ``a + b * active`` (a = 10 ms, b = 0.05 ms: decode is bound by
reading the weights, nearly flat in the batch; it sleeps, as a GPU wait does), prompts of 13 tokens, output
lengths uniform in 8..128 new tokens (each request's ``max_new_tokens``; the model emits no EOS, so every
sequence runs to it).

Both sides get the same memory: what static batching needs for a full batch of 32, each sequence's cache
held to the longest one's end (32 * (prompt + 128) tokens). Continuous batching (the worker's
``GenerationWorker`` thread and ``StepScheduler``) gets it as ``max_batch_tokens``: each sequence reserves
its own prompt + ``max_new_tokens`` and leaves at its last token. Static batching takes up to 32 queued
requests (high lane first), runs them together to the longest one's end, and returns them all then.

Continuous batching runs with ``admission: grow`` (a sequence counts the tokens its cache holds; the lowest
lane's latest sequence is preempted and recomputed on overflow); an info row gives ``reserve`` (each
sequence holds prompt + max_new_tokens from admission).

Rows:
- throughput, a backlog of N requests at t = 0: continuous / static (target >= 2.3);
- mean latency (arrival -> result), the same Poisson arrivals at 70% of static batching's saturated rate:
  continuous / static (target <= 0.6);
- high-lane time to first token: two lanes (``high`` priority 1, weight 4, 10% of the requests; ``low``),
  continuous batching at 2x its saturated rate vs at 10% of it (target <= 2).

This scenario drives the device side in process (a feed stands in for the dispatch room, high lane first);
the path through Kafka is tests/integration/test_generative.py's.
"""

from __future__ import annotations

import queue
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from tests.bench.common import Ctx, log, row
from worker.config.settings import GenerationConfig, ModelConfig
from worker.core.records import Batch, Record, TopicPartition
from worker.core.step_model import GenParams
from worker.core.step_scheduler import LaneRule
from worker.models.generative import GenerativeModel, GenRequest
from worker.models.registry import load_model
from worker.pipeline.generation import GenerationWorker

# A decode step reads every weight once whatever the batch: nearly flat in the active sequences.
A_MS, B_MS = 10.0, 0.05
STATIC_B = 32
MIN_NEW, MAX_NEW = 8, 128
PROMPT = "request {:05d}"  # 13 tokens (bytes)
MEMORY_TOKENS = STATIC_B * (len(PROMPT.format(0)) + MAX_NEW)
HEADROOM = 2 * (len(PROMPT.format(0)) + MAX_NEW)  # two of the high lane's largest sequences
LANES = [LaneRule("high", priority=1, weight=4.0), LaneRule("low", priority=0, weight=1.0)]
TP = TopicPartition("bench", 0)


@dataclass
class Req:
    i: int
    lane: str
    new_tokens: int
    at: float  # arrival, seconds after the start
    first_token: float | None = None
    done: float | None = None


@dataclass
class Feed:
    """The dispatch room's part: arrivals released at their time, high lane first."""

    reqs: list[Req]
    t0: float = 0.0
    lanes: dict[str, queue.SimpleQueue[Record]] = field(default_factory=lambda: {
        "high": queue.SimpleQueue(), "low": queue.SimpleQueue()})
    _next: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def release(self, now: float) -> None:
        with self.lock:
            while self._next < len(self.reqs) and self.t0 + self.reqs[self._next].at <= now:
                r = self.reqs[self._next]
                rec = Record(TP, r.i, b"", received_at=self.t0 + r.at, id=str(r.i), lane=r.lane)
                rec.item = GenRequest(PROMPT.format(r.i), GenParams(max_new_tokens=r.new_tokens, seed=r.i))
                self.lanes[r.lane].put(rec)
                self._next += 1

    def pop(self, limit: int, only: frozenset[str] | None = None) -> list[Record]:
        self.release(time.monotonic())
        out: list[Record] = []
        for lane in ("high", "low"):
            if only is not None and lane not in only:
                continue
            q = self.lanes[lane]
            while len(out) < limit:
                try:
                    out.append(q.get_nowait())
                except queue.Empty:
                    break
        return out

    def wait_any(self, timeout: float) -> None:
        until = time.monotonic() + timeout
        while time.monotonic() < until:
            self.release(time.monotonic())
            if not (self.lanes["high"].empty() and self.lanes["low"].empty()):
                return
            nxt = self.reqs[self._next].at + self.t0 if self._next < len(self.reqs) else until
            time.sleep(max(0.0, min(until, nxt) - time.monotonic()))


def make_reqs(n: int, rate: float | None, seed: int, high_share: float = 0.0) -> list[Req]:
    rnd = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if rate is not None:
            t += rnd.expovariate(rate)
        lane = "high" if rnd.random() < high_share else "low"
        out.append(Req(i, lane, rnd.randint(MIN_NEW, MAX_NEW), t))
    return out


def model(admission: str = "grow") -> GenerativeModel:
    m = load_model(ModelConfig(name="synthetic-lm", options={"a_ms": A_MS, "b_ms": B_MS},
                               generation=GenerationConfig(max_new_tokens=MAX_NEW, max_sequences=128,
                                                           max_batch_tokens=MEMORY_TOKENS,
                                                           priority_headroom_tokens=HEADROOM,
                                                           admission=admission)))  # type: ignore[arg-type]
    assert isinstance(m, GenerativeModel)
    return m


def run_continuous(reqs: list[Req], admission: str = "grow") -> float:
    """Seconds from the start to the last result."""
    m, feed = model(admission), Feed(reqs)
    by_id = {r.i: r for r in reqs}
    left = threading.Semaphore(0)

    def take(timeout: float, in_flight: int, only: frozenset[str] | None) -> Batch | None:
        if not in_flight:
            feed.wait_any(timeout)
        recs = feed.pop(32, only)  # a lane's max_batch_size
        if not recs:
            return None
        now = time.monotonic()
        return Batch("low", recs, now, now, "bench")

    def done(batch: Batch, outs: list[Any], timings: dict[str, float]) -> None:
        now = time.monotonic()
        for rec, out in zip(batch.records, outs, strict=True):
            r = by_id[rec.offset]
            r.done = now - feed.t0
            r.first_token = (rec.received_at - feed.t0) + out.ttft_ms / 1000.0
            left.release()

    w = GenerationWorker(m, "cpu", lanes=LANES, limits=m.limits, take=take, done=done,
                         is_current=lambda r: True, poll_s=0.01)
    w.setup()
    feed.t0 = time.monotonic()
    w.start()
    for _ in reqs:
        left.acquire()
    w.stop(5)
    return max(r.done or 0.0 for r in reqs)


def run_static(reqs: list[Req]) -> float:
    m, feed = model(), Feed(reqs)
    m.setup("cpu")
    sm = m.step_model()
    feed.t0 = time.monotonic()
    finished, ids = 0, 0
    while finished < len(reqs):
        feed.wait_any(1.0)
        batch = feed.pop(STATIC_B)
        if not batch:
            continue
        seqs = []
        for rec in batch:
            req: GenRequest = rec.item
            sm.start(ids, sm.encode(req.prompt), req.params)
            seqs.append(ids)
            ids += 1
        longest = max(rec.item.params.max_new_tokens for rec in batch)
        first = time.monotonic() - feed.t0
        for _ in range(longest):  # padded: every sequence is in every step to the longest one's end
            sm.step(seqs)
        end = time.monotonic() - feed.t0
        for rec, sid in zip(batch, seqs, strict=True):
            sm.release(sid)
            r = reqs[rec.offset]
            r.done, r.first_token = end, first
        finished += len(batch)
    return max(r.done or 0.0 for r in reqs)


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def run(ctx: Ctx) -> dict[str, Any]:
    n = 400 if ctx.quick else 1000
    rows: list[dict[str, Any]] = []
    res: dict[str, Any] = {"a_ms": A_MS, "b_ms": B_MS, "static_batch": STATIC_B,
                           "memory_tokens": MEMORY_TOKENS}

    t_cont = run_continuous(make_reqs(n, None, seed=1))
    t_res = run_continuous(make_reqs(n, None, seed=1), admission="reserve")
    t_static = run_static(make_reqs(n, None, seed=1))
    thr_c, thr_r, thr_s = n / t_cont, n / t_res, n / t_static
    res["throughput"] = {"continuous_grow_rps": thr_c, "continuous_reserve_rps": thr_r, "static_rps": thr_s}
    log(f"generative: backlog of {n}: continuous {thr_c:.1f}/s (reserve admission {thr_r:.1f}/s), "
        f"static {thr_s:.1f}/s")
    rows.append(row("28 generative throughput", "continuous batching (grow admission), requests/s", thr_c,
                    "static batching", thr_s, ">=", 2.3, "req/s",
                    f"backlog of {n}, 8-128 new tokens, same token memory"))
    rows.append(row("28 generative throughput", "continuous batching (reserve admission), requests/s", thr_r,
                    "static batching", thr_s, "info", 0, "req/s",
                    "each sequence holds prompt + max_new_tokens"))

    rate = 0.7 * thr_s
    paced = make_reqs(n, rate, seed=2)
    run_continuous(paced)
    lat_c = mean([(r.done or 0.0) - r.at for r in paced])
    paced_s = make_reqs(n, rate, seed=2)
    run_static(paced_s)
    lat_s = mean([(r.done or 0.0) - r.at for r in paced_s])
    res["latency"] = {"rate_rps": rate, "continuous_mean_s": lat_c, "static_mean_s": lat_s}
    log(f"generative: at {rate:.1f}/s mean latency continuous {lat_c * 1000:.0f} ms, static "
        f"{lat_s * 1000:.0f} ms")
    rows.append(row("28 generative latency", "continuous batching, mean latency", lat_c * 1000,
                    "static batching", lat_s * 1000, "<=", 0.6, "ms",
                    f"Poisson arrivals at {rate:.1f}/s (70% of static's saturated rate)"))

    def high_ttft(load: float, count: int) -> float:
        reqs = make_reqs(count, load * thr_c, seed=3, high_share=0.1)
        run_continuous(reqs)
        warm = [r for r in reqs if r.lane == "high" and r.at > reqs[-1].at * 0.2]
        return mean([(r.first_token or 0.0) - r.at for r in warm])

    over = high_ttft(2.0, n)
    light = high_ttft(0.1, max(60, n // 6))
    res["ttft"] = {"high_overload_2x_s": over, "high_light_10pct_s": light}
    log(f"generative: high-lane TTFT 2x overload {over * 1000:.1f} ms, 10% load {light * 1000:.1f} ms")
    rows.append(row("28 generative high-lane TTFT", "2x overload, mean TTFT", over * 1000,
                    "10% load", light * 1000, "<=", 2.0, "ms",
                    "high lane 10% of traffic, priority 1, weight 4"))
    res["rows"] = rows
    return res


if __name__ == "__main__":
    import json
    import sys
    from pathlib import Path

    out = run(Ctx("-", Path("/tmp"), quick="--full" not in sys.argv))
    print(json.dumps({k: v for k, v in out.items() if k != "rows"}, indent=1))
    for r in out["rows"]:
        print(r["scenario"], r["value"], r["baseline_value"], r["ratio"], r["target"], r["verdict"])
