"""Token budgets vs count-only batching on a length-skewed corpus, ``minilm`` on CPU, same worst case.

Corpus: most texts short (8-40 tokens), some long (230-256 tokens, the model's limit), in a seeded random
order. Both modes batch it as a lane does (``MicroBatcher``: arrival order, one lane; with
``batching.bucket_width`` 16, and again without bucketing) and run the handler's ``collate`` -> ``forward``
-> ``split`` per batch:

- count only: ``max_batch_size = budget // max_tokens``, so its worst batch (all long) costs the budget;
- token budget: ``max_batch_tokens = budget`` (``max_batch_size`` large), so no batch costs more.

Both have the same worst-case memory by construction; the question is what each does with it. The handler
pads a batch to its longest record, so without bucketing a batch of many short records and one long one
costs the budget in real tokens but many times more in padded ones: the rows without bucketing show what
that does. Figures:
throughput (texts/s over the passes, tokenizing excluded) and peak memory two ways: peak RSS growth of a
fresh child process per mode (``ru_maxrss`` at the end minus the RSS before its first batch, after a
warm-up), and the largest batch's padded tokens x hidden size x 4 bytes (one fp32 activation tensor: a
proxy that does not depend on the allocator). Ratios are token budget / count only.

``python -m tests.bench.token_budget [--quick] [--bucket-width N]`` prints the JSON result of one pair;
``run_all`` calls ``run`` (both pairs).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time
from typing import Any

from tests.bench.common import Ctx, log, row

MAX_TOKENS = 256  # minilm's default limit: the longest record
BUDGET = 16 * MAX_TOKENS  # token budget = count-only max batch (16) x the longest record
TOKEN_MODE_MAX_BATCH = 256  # the token mode's max_batch_size: the budget, not the count, bounds its batches
BUCKET = 16
LONG_SHARE = 0.12
WORDS = ["stream", "event", "batch", "token", "window", "kafka", "offset", "model", "device", "memory",
         "lane", "priority", "deadline", "partition", "commit", "result", "topic", "shard"]


def corpus(n: int, seed: int = 7) -> list[str]:
    """``n`` texts, ~``LONG_SHARE`` of them long: words the tokenizer maps to one token each, mostly."""
    rnd = random.Random(seed)
    out = []
    for _ in range(n):
        words = rnd.randint(225, 260) if rnd.random() < LONG_SHARE else rnd.randint(6, 38)
        out.append(" ".join(rnd.choice(WORDS) for _ in range(words)))
    return out


def _rss_kb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() // 1024


def one_mode(mode: str, n: int, bucket: int) -> dict[str, Any]:
    """Runs in a child process: batch the corpus in ``mode`` ("count" or "tokens") and time the passes."""
    import torch

    from worker.core.batcher import MicroBatcher
    from worker.core.records import Record, TopicPartition
    from worker.device.placement import configure_threads
    from worker.models.inputs import TextInput
    from worker.models.minilm import MiniLMModel

    configure_threads("cpu")
    model = MiniLMModel(max_tokens=MAX_TOKENS)
    model.setup("cpu")
    hidden = int(model.model.config.hidden_size)
    items = [model.decode(TextInput(text=t)) for t in corpus(n)]
    tp = TopicPartition("in", 0)
    recs = [Record(tp=tp, offset=i, value=b"", item=x, size=model.size_of(x)) for i, x in enumerate(items)]
    if mode == "count":
        b = MicroBatcher("L", BUDGET // MAX_TOKENS, 1.0, bucket)
    else:
        b = MicroBatcher("L", TOKEN_MODE_MAX_BATCH, 1.0, bucket, max_batch_tokens=BUDGET)
    batches = [x for r in recs for x in b.add(r, 0.0)] + b.flush(0.0)
    assert sum(len(x) for x in batches) == n
    padded = [len(x) * max(r.size for r in x.records) for x in batches]
    with torch.inference_mode():  # warm-up: a small batch, so the pass's peak is its own
        model.split(model.forward(model.collate(items[:2])), 2)
        before = _rss_kb()
        t0 = time.perf_counter()
        for x in batches:
            its = [r.item for r in x.records]
            model.split(model.forward(model.collate(its)), len(its))
        took = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"mode": mode, "texts": n, "batches": len(batches), "seconds": took, "texts_per_s": n / took,
            "mean_batch": n / len(batches), "max_padded_tokens": max(padded),
            "padded_tokens_total": sum(padded), "real_tokens_total": sum(r.size for r in recs),
            "proxy_peak_mb": max(padded) * hidden * 4 / 2**20, "rss_growth_mb": max(0, peak - before) / 1024,
            "torch_threads": torch.get_num_threads()}


def _child(mode: str, n: int, bucket: int) -> dict[str, Any]:
    argv = [sys.executable, "-m", "tests.bench.token_budget", "--child", mode, "--texts", str(n),
            "--bucket-width", str(bucket)]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure(n: int, bucket: int) -> dict[str, Any]:
    count, tokens = _child("count", n, bucket), _child("tokens", n, bucket)
    res: dict[str, Any] = {"budget": BUDGET, "max_tokens": MAX_TOKENS, "long_share": LONG_SHARE,
                           "bucket": bucket, "count": count, "tokens": tokens,
                           "throughput_ratio": tokens["texts_per_s"] / count["texts_per_s"],
                           "rss_growth_ratio": (tokens["rss_growth_mb"] / count["rss_growth_mb"]
                                                if count["rss_growth_mb"] else float("nan")),
                           "proxy_peak_ratio": tokens["proxy_peak_mb"] / count["proxy_peak_mb"]}
    return res


def pair_rows(res: dict[str, Any]) -> list[dict[str, Any]]:
    c, t = res["count"], res["tokens"]
    what = (f"budget {res['budget']} tokens vs max_batch_size {res['budget'] // res['max_tokens']}; "
            f"{c['texts']} texts, {res['long_share']:.0%} long")
    name = f"token budget vs count only, bucket_width {res['bucket']}" if res["bucket"] else \
        "token budget vs count only, no bucketing"
    return [
        row(name, "texts/s", t["texts_per_s"], "count-only batching, same worst case",
            c["texts_per_s"], "info", 0, "texts/s",
            f"{what}; mean batch {t['mean_batch']:.1f} vs {c['mean_batch']:.1f} records"),
        row(name, "peak RSS growth, MB", t["rss_growth_mb"], "count-only batching",
            c["rss_growth_mb"], "info", 0, "MB",
            "ru_maxrss minus RSS before the first batch, one child per mode"),
        row(name, "largest batch: padded tokens x hidden x 4 B, MB", t["proxy_peak_mb"],
            "count-only batching", c["proxy_peak_mb"], "info", 0, "MB",
            f"{t['max_padded_tokens']} vs {c['max_padded_tokens']} padded tokens"),
    ]


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    res["rows"] = [r for pair in res["pairs"] for r in pair_rows(pair)]
    return res


def run(ctx: Ctx) -> dict[str, Any]:
    n = 600 if ctx.quick else 3000
    pairs = [measure(n, BUCKET), measure(n, 0)]
    for p in pairs:
        log(f"token budget (bucket_width {p['bucket']}): {p['tokens']['texts_per_s']:.1f} texts/s vs "
            f"count only {p['count']['texts_per_s']:.1f} (x{p['throughput_ratio']:.2f}); "
            f"RSS growth x{p['rss_growth_ratio']:.2f}; largest batch x{p['proxy_peak_ratio']:.2f}")
    return summarize({"pairs": pairs})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", choices=["count", "tokens"], help=argparse.SUPPRESS)
    ap.add_argument("--texts", type=int, default=3000)
    ap.add_argument("--quick", action="store_true", help="600 texts")
    ap.add_argument("--bucket-width", type=int, default=BUCKET,
                    help="batching.bucket_width of both modes (0: none)")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(one_mode(a.child, a.texts, a.bucket_width)))
        return 0
    res = measure(600 if a.quick else a.texts, a.bucket_width)
    print(json.dumps(res, indent=2))
    for key in ("throughput_ratio", "rss_growth_ratio", "proxy_peak_ratio"):
        print(f"{key}: {res[key]:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
