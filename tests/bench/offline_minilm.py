"""Offline baseline for the real-model benchmark: the ``minilm`` handler run directly over the same texts, no
Kafka, no threads: tokenize (the handler's ``decode``) -> ``collate`` -> ``forward`` (inference_mode) -> ``split``
per batch, texts in their arrival order, torch threads as the worker sets them (``configure_threads``).

``python -m tests.bench.offline_minilm --texts FILE.json --batch-sizes 8,16,32,64`` prints JSON
``{"threads": t, "rates": {bs: texts/s}, "sorted_rate": texts/s at the best bs with texts sorted by length}``.
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


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--texts", required=True)
    ap.add_argument("--batch-sizes", default="8,16,32,64")
    ap.add_argument("--no-sorted", action="store_true", help="skip the pass over texts sorted by length")
    args = ap.parse_args()
    from worker.adapters.torch_engine import configure_threads
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
    print(json.dumps({"threads": threads, "rates": rates, "best_batch": best, "sorted_rate": sorted_rate}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
