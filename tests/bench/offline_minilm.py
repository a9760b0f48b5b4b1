"""Offline baseline for the real-model benchmark: the ``minilm`` handler run directly over the same texts, no
Kafka, no threads: tokenize (the handler's ``decode``) -> ``collate`` -> ``forward`` (inference_mode) ->
``split`` per batch, texts in their arrival order, torch threads as the worker sets them
(``configure_threads``).

``python -m tests.bench.offline_minilm --texts FILE.json --batch-sizes 8,16,32,64 [--bucket-width 8]`` prints
JSON ``{"threads": t, "rates": {bs: texts/s}, "best_batch": bs, "sorted_rate": texts/s at the best bs with the
texts sorted by length, "bucketed_rates": {bs: texts/s}}``. The bucketed passes group the texts, in arrival
order, by token count // bucket width as the worker's ``batching.bucket_width`` does, and run a bucket's batch
when it holds bs texts (what is left at the end runs last): the offline counterpart of the worker with
bucketing. Sorting the whole corpus by length is more than a stream can do (it never sees all the texts).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any


def run_pass(model: Any, texts: list[str], bs: int) -> float:
    import torch

    from worker.models.inputs import TextInput

    t0 = time.perf_counter()
    with torch.inference_mode():
        for i in range(0, len(texts), bs):
            items = [model.decode(TextInput(text=t)) for t in texts[i:i + bs]]
            out = model.forward(model.collate(items))
            model.split(out, len(items))
    return len(texts) / (time.perf_counter() - t0)


def run_bucketed(model: Any, texts: list[str], bs: int, width: int) -> float:
    import torch

    from worker.models.inputs import TextInput

    t0 = time.perf_counter()
    buckets: dict[int, list[Any]] = {}
    with torch.inference_mode():
        for t in texts:
            item = model.decode(TextInput(text=t))
            b = buckets.setdefault(model.size_of(item) // width, [])
            b.append(item)
            if len(b) == bs:
                model.split(model.forward(model.collate(b)), bs)
                b.clear()
        for b in buckets.values():
            if b:
                model.split(model.forward(model.collate(b)), len(b))
    return len(texts) / (time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--texts", required=True)
    ap.add_argument("--batch-sizes", default="8,16,32,64")
    ap.add_argument("--no-sorted", action="store_true", help="skip the pass over texts sorted by length")
    ap.add_argument("--bucket-width", type=int, default=0,
                    help="also run a bucketed pass at every batch size (0: none)")
    args = ap.parse_args()
    from worker.device.engine import configure_threads
    from worker.models.minilm import MiniLMModel

    texts: list[str] = json.loads(open(args.texts).read())
    threads = configure_threads("cpu")
    model = MiniLMModel()
    model.setup("cpu")
    run_pass(model, texts[:64], 16)  # warm-up
    rates = {bs: run_pass(model, texts, bs) for bs in (int(x) for x in args.batch_sizes.split(","))}
    best = max(rates, key=lambda b: rates[b])
    sorted_rate = None
    if not args.no_sorted:
        lengths = {t: len(model.tokenizer.encode(t).ids) for t in texts}
        sorted_rate = run_pass(model, sorted(texts, key=lambda t: lengths[t]), best)
    bucketed = ({bs: run_bucketed(model, texts, bs, args.bucket_width) for bs in rates}
                if args.bucket_width > 0 else {})
    print(json.dumps({"threads": threads, "rates": rates, "best_batch": best, "sorted_rate": sorted_rate,
                      "bucketed_rates": bucketed}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
