"""Issue 28 item 3 - which generation engine: the same 64 greedy requests through three engines on tiny-lm.

    python -m tests.bench.gen_engines [--requests 64] [--repeat 3] [--device cpu] [--json FILE]

All requests arrive at once (prompts of 8-40 bytes, 4-96 new tokens, uniform, fixed seed); a request ends
at EOS or its own ``max_new_tokens``. Engines:

- ``hf-continuous``: transformers' continuous batching manager (``continuous_batching_context_manager``,
  one ``add_request`` per request with its own ``max_new_tokens``; what ``generate_batch`` runs, which
  takes one ``max_new_tokens`` for all);
- ``hf-static-16``: plain ``generate`` over static batches of 16 (left-padded), each batch run to its
  longest request, the batches one after the other; a request's latency is its batch's end;
- ``step-model-16`` / ``step-model-64``: ``HFStepModel`` (worker/models/causal_lm.py) driven by the minimal
  continuous loop below, 16 or 64 slots: a finished sequence leaves at once and the next request takes its
  slot at the next step.

Figures: useful new tokens per second (the tokens each request asked for, to EOS) and mean latency from
arrival to last token; the best of ``--repeat`` runs counts (the machine is shared). Every engine's tokens
are compared with the step model's; ``agree`` counts requests with the same tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from worker.core.step_model import GenParams  # noqa: E402
from worker.models.causal_lm import HFStepModel  # noqa: E402
from worker.models.tiny_lm import TinyLM  # noqa: E402

Request = tuple[list[int], int]  # prompt ids, max new tokens
Outcome = tuple[list[list[int]], list[float], float]  # tokens per request, latency per request (s), wall (s)


def requests(n: int, seed: int = 28) -> list[Request]:
    rng = random.Random(seed)
    return [([rng.randrange(32, 127) for _ in range(rng.randint(8, 40))],
             rng.randint(4, 96)) for _ in range(n)]


def _cut(tokens: list[int], n: int, eos: int | None) -> list[int]:
    tokens = tokens[:n]
    return tokens[: tokens.index(eos) + 1] if eos is not None and eos in tokens else tokens


def step_loop(m: HFStepModel, reqs: list[Request], slots: int) -> Outcome:
    """A minimal continuous loop: FIFO admission into free slots, one ``step`` over all active sequences."""
    t0 = time.perf_counter()
    out: list[list[int]] = [[] for _ in reqs]
    lat = [0.0] * len(reqs)
    waiting = list(range(len(reqs)))
    active: list[int] = []
    while waiting or active:
        while waiting and len(active) < slots:
            i = waiting.pop(0)
            m.start(i, reqs[i][0], GenParams(max_new_tokens=reqs[i][1]))
            active.append(i)
        for i, t in zip(list(active), m.step(active), strict=True):
            out[i].append(t)
            if t == m.eos_token_id or len(out[i]) >= reqs[i][1]:
                lat[i] = time.perf_counter() - t0
                active.remove(i)
                m.release(i)
    return out, lat, time.perf_counter() - t0


def static_generate(model: Any, reqs: list[Request], batch: int, pad: int, eos: int | None) -> Outcome:
    t0 = time.perf_counter()
    out: list[list[int]] = []
    lat: list[float] = []
    for b in range(0, len(reqs), batch):
        group = reqs[b : b + batch]
        width = max(len(p) for p, _ in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in group], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group], device=model.device)
        with torch.inference_mode():
            gen = model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                                 max_new_tokens=max(n for _, n in group))
        done = time.perf_counter() - t0
        for row, (_, n) in zip(gen[:, width:].tolist(), group, strict=True):
            out.append(_cut(row, n, eos))
            lat.append(done)
    return out, lat, time.perf_counter() - t0


def hf_continuous(model: Any, reqs: list[Request], eos: int | None) -> Outcome:
    from transformers import GenerationConfig

    cfg = GenerationConfig(do_sample=False, max_new_tokens=max(n for _, n in reqs), eos_token_id=eos,
                           pad_token_id=model.generation_config.pad_token_id)
    out: list[list[int]] = [[] for _ in reqs]
    lat = [0.0] * len(reqs)
    with model.continuous_batching_context_manager(generation_config=cfg, block=True, timeout=30) as mgr:
        t0 = time.perf_counter()
        index = {mgr.add_request(p, request_id=f"r{i}", max_new_tokens=n): i for i, (p, n) in enumerate(reqs)}
        left = len(reqs)
        while left:
            res = mgr.get_result(timeout=1)
            if res is None:
                if not mgr.is_running():
                    raise RuntimeError("the continuous batching manager stopped")
                continue
            if res.is_finished():
                i = index[res.request_id]
                out[i] = _cut(list(res.generated_tokens), reqs[i][1], eos)
                lat[i] = time.perf_counter() - t0
                left -= 1
        wall = time.perf_counter() - t0
    return out, lat, wall


def measure(device: str, n: int, repeat: int, only: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """One row per engine (those named in ``only``, else all)."""
    handler = TinyLM()
    handler.setup(device)
    m = handler.step_model()
    assert isinstance(m, HFStepModel)
    model, eos = m.model, m.eos_token_id
    pad = int(model.generation_config.pad_token_id)
    reqs = requests(n)
    engines: dict[str, Callable[[list[Request]], Outcome]] = {
        "hf-continuous": lambda r: hf_continuous(model, r, eos),
        "hf-static-16": lambda r: static_generate(model, r, 16, pad, eos),
        "step-model-16": lambda r: step_loop(m, r, 16),
        "step-model-64": lambda r: step_loop(m, r, 64),
    }
    want = step_loop(m, reqs, 64)[0]  # also the warm-up of torch's kernels
    useful = sum(len(t) for t in want)
    rows = []
    for name, run in engines.items():
        if only and name not in only:
            continue
        run(reqs[:4])  # warm-up
        best: Outcome | None = None
        for _ in range(repeat):
            got = run(reqs)
            if best is None or got[2] < best[2]:
                best = got
        assert best is not None
        tokens, lat, wall = best
        rows.append({"engine": name, "wall_s": wall, "tokens_per_s": useful / wall,
                     "mean_latency_s": sum(lat) / len(lat),
                     "agree": sum(a == b for a, b in zip(tokens, want, strict=True)), "requests": len(reqs)})
        print(f"  {name:<15} {wall:7.2f} s  {useful / wall:8.0f} tok/s  mean latency "
              f"{rows[-1]['mean_latency_s']:6.2f} s  agree {rows[-1]['agree']}/{len(reqs)}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3, help="runs per engine; the fastest counts")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: a tiny model gains nothing from more, and a shared machine "
                         "slows spinning threads down)")
    ap.add_argument("--json", type=Path, help="also write the rows here")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(f"tiny-lm on {a.device}, {a.requests} requests of 4-96 new tokens, torch threads "
          f"{torch.get_num_threads()}, best of {a.repeat}", flush=True)
    rows = measure(a.device, a.requests, a.repeat)
    base = next(r for r in rows if r["engine"] == "hf-static-16")
    print(f"{'engine':<15} {'tokens/s':>9} {'x static':>9} {'mean lat s':>11} {'x static':>9}")
    for r in rows:
        print(f"{r['engine']:<15} {r['tokens_per_s']:9.0f} {r['tokens_per_s'] / base['tokens_per_s']:9.2f} "
              f"{r['mean_latency_s']:11.3f} {r['mean_latency_s'] / base['mean_latency_s']:9.2f}")
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
