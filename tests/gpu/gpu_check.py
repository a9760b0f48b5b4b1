"""Every GPU check in one script; prints a table (and writes it, with the batch-size curve, under --out).

    python tests/gpu/gpu_check.py                     # on a CUDA machine
    python tests/gpu/gpu_check.py --device cpu --quick  # dry run anywhere

Checks:
  minilm_vs_cpu     minilm embeddings on the device vs CPU fp32: min cosine >= 0.999 (bf16: >= 0.99)
  pipeline_ratio    DeviceWorker throughput (collate/H2D/forward/D2H/split, overlapped) divided by the bare
                    forward throughput (pre-collated batch on the device, forward + output copy only) at
                    the same batch size: target >= 0.9 - the device must not wait for Python
  dtype_speedup     minilm throughput bf16 / fp32 and fp16 / fp32 (info)
  real_oom          a real CUDA OOM (memory fraction capped) is split: every record gets the embedding it gets
                    without the cap, in order, and the lane's limit drops (CUDA only)
  profile_curve     worker profile's batch-size curve for minilm (table + PNG): a recommended size that ran
                    within the 50 ms p99 budget, no size failing other than out of memory
  feed              issue 27 - can the host feed the device? minilm's bare forward throughput at its best
                    batch size, fp16 and bf16 (info); the DeviceWorker pipeline / bare forward at that batch:
                    target >= 0.9; the null-device ceiling (minilm whose forward costs nothing: tokenizing
                    on the host threads, collate, copy, split) at that batch, and its ratio to the bare
                    forward (info: above 1, the host path outruns the device)
Exit code 0 when every PASS/FAIL check passed.

Status: not yet run on a GPU (no CUDA machine has been available); its CPU-safe parts run in
tests/unit/test_gpu_check_cpu.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from worker.config.settings import ModelConfig  # noqa: E402
from worker.core.records import Batch, Record, TopicPartition  # noqa: E402
from worker.device.engine import DeviceWorker, Engine  # noqa: E402
from worker.models.registry import load_model  # noqa: E402

Result = dict[str, Any]  # name, value, target, status (PASS|FAIL|INFO|SKIP), detail


def engine(device: str, dtype: str = "fp32", name: str = "minilm", **kw: Any) -> Engine:
    eng = Engine(load_model(ModelConfig(name=name)), device, dtype=dtype, **kw)
    eng.setup()
    return eng


def embed(eng: Engine, texts: list[str]) -> torch.Tensor:
    from worker.models.inputs import TextInput

    out = eng.infer([TextInput(text=t) for t in texts])  # minilm decodes on the engine's host threads
    bad = [o for o in out if isinstance(o, BaseException)]
    if bad:
        raise RuntimeError(f"{len(bad)} records failed: {bad[0]!r}")
    return torch.tensor(out)


def texts(n: int) -> list[str]:
    from worker.models.minilm import SAMPLE_SENTENCES

    return [f"{SAMPLE_SENTENCES[i % len(SAMPLE_SENTENCES)]} #{i}" for i in range(n)]


def make_batch(items: list[Any], offset: int) -> Batch:
    recs = [Record(TopicPartition("gpu-check", 0), offset + i, b"", item=it) for i, it in enumerate(items)]
    return Batch("default", recs, 0.0, 0.0, "count", len(recs))


# --------------------------------------------------------------------------------------------------- checks


def check_minilm_vs_cpu(device: str, quick: bool) -> list[Result]:
    sample = texts(16 if quick else 64)
    ref = embed(engine("cpu", warmup=False), sample)
    out = []
    for dtype, target in (("fp32", 0.999), ("bf16", 0.99)):
        got = embed(engine(device, dtype), sample)
        cos = torch.nn.functional.cosine_similarity(got, ref, dim=1).min().item()
        out.append({"name": f"minilm_vs_cpu[{dtype}]", "value": round(cos, 6), "target": f">= {target}",
                    "status": "PASS" if cos >= target else "FAIL",
                    "detail": f"{len(sample)} texts on {device}"})
    return out


def bare_throughput(eng: Engine, items: list[Any], iters: int) -> float:
    """items/s of forward alone: one pre-collated batch already on the device, outputs copied back."""
    prepared = eng.prepare(items)
    sync = torch.cuda.synchronize if eng.is_cuda else (lambda *a: None)
    for _ in range(3):
        eng.launch(prepared)
    sync()
    t = time.perf_counter()
    for _ in range(iters):
        eng.launch(prepared)
    sync()
    return len(items) * iters / (time.perf_counter() - t)


def pipeline_throughput(eng: Engine, items: list[Any], iters: int) -> float:
    """items/s through a DeviceWorker fed ``iters`` batches of ``items`` (as fast as it takes them)."""
    lock = threading.Lock()
    batches = [make_batch(items, i * len(items)) for i in range(iters)]
    finished = threading.Event()
    count = [0]
    failures: list[BaseException] = []

    def take(timeout: float) -> Batch | None:
        with lock:
            return batches.pop(0) if batches else None

    def done(batch: Batch, results: list[Any], timings: dict[str, float]) -> None:
        failures.extend(r for r in results if isinstance(r, BaseException))
        count[0] += 1
        if count[0] == iters or failures:
            finished.set()

    w = DeviceWorker(eng, take, done, name="gpu-check")
    t = time.perf_counter()
    w.start()
    if not finished.wait(300):
        raise TimeoutError("pipeline did not finish")
    elapsed = time.perf_counter() - t
    w.stop(30)
    if failures:
        raise RuntimeError(f"pipeline batch failed: {failures[0]!r}")
    return len(items) * iters / elapsed


def check_pipeline_ratio(device: str, quick: bool) -> list[Result]:
    out = []
    eng = engine(device)
    for bs in ([16] if quick else [32, 128]):
        items = eng.example_items(bs)
        iters = 10 if quick else max(50, 4000 // bs)
        bare = bare_throughput(eng, items, iters)
        pipe = pipeline_throughput(eng, items, iters)
        ratio = pipe / bare
        out.append({"name": f"pipeline_ratio[bs={bs}]", "value": round(ratio, 3), "target": ">= 0.9",
                    "status": "PASS" if ratio >= 0.9 else "FAIL",
                    "detail": f"pipeline {pipe:.0f} items/s, bare forward {bare:.0f} items/s"})
    return out


def check_dtype_speedup(device: str, quick: bool) -> list[Result]:
    bs = 16 if quick else 128
    iters = 5 if quick else 50
    rates = {}
    for dtype in ("fp32", "bf16", "fp16"):
        if dtype == "fp16" and not device.startswith("cuda"):
            continue
        eng = engine(device, dtype)
        rates[dtype] = bare_throughput(eng, eng.example_items(bs), iters)
    out = []
    for dtype in ("bf16", "fp16"):
        if dtype in rates:
            out.append(
                {
                    "name": f"dtype_speedup[{dtype}/fp32]",
                    "value": round(rates[dtype] / rates["fp32"], 2),
                    "target": "info",
                    "status": "INFO",
                    "detail": f"{dtype} {rates[dtype]:.0f} vs fp32 {rates['fp32']:.0f} items/s at bs={bs}",
                }
            )
    return out


def same_rows(got: torch.Tensor, ref: torch.Tensor, atol: float = 1e-3) -> str | None:
    """Why ``got`` is not ``ref`` row for row (None when it is): every row close to its own reference row and
    nearer to it than to any other (a right shape with rows swapped, zeroed or repeated is a failure)."""
    if got.shape != ref.shape:
        return f"shape {tuple(got.shape)}, want {tuple(ref.shape)}"
    diff = (got - ref).abs().max().item()
    if diff > atol:
        return f"max |got - ref| {diff:.2e} > {atol:g}"
    nearest = torch.cdist(got.double(), ref.double()).argmin(dim=1)
    moved = (nearest != torch.arange(len(ref))).nonzero().flatten().tolist()
    if moved:
        return f"{len(moved)} rows nearer to another record's reference (first: row {moved[0]})"
    return None


def check_real_oom(device: str, quick: bool) -> list[Result]:
    if not device.startswith("cuda"):
        return [{"name": "real_oom", "value": "-", "target": "same outputs, limit lowered", "status": "SKIP",
                 "detail": "needs CUDA (memory fraction cap)"}]
    long_text = "streaming inference on a saturated device " * 40  # > 256 tokens: truncated to 256
    # Each record's own words first (truncation keeps the first 256 tokens): distinct outputs, so rows handed
    # to the wrong records, or lost, show in the comparison with the reference.
    sample = [f"{t} {long_text}" for t in texts(512)]
    # The reference: the same texts on the same device without the cap, in batches that fit.
    ref_eng = engine(device, warmup=False)
    ref = torch.cat([embed(ref_eng, sample[i : i + 32]) for i in range(0, len(sample), 32)])
    del ref_eng
    torch.cuda.empty_cache()
    limits: list[tuple[str, int]] = []
    eng = engine(device, on_limit=lambda lane, n: limits.append((lane, n)))
    free, total = torch.cuda.mem_get_info(device)
    used = torch.cuda.memory_allocated(device)
    # Leave ~600 MiB above what the weights use: a 512 x 256-token batch needs several GiB.
    frac = min(0.9, (used + 600 * 2**20) / total)
    torch.cuda.set_per_process_memory_fraction(frac, device)
    try:
        torch.cuda.empty_cache()
        got = embed(eng, sample)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        torch.cuda.empty_cache()
    wrong = same_rows(got, ref)
    limit = eng.effective_max("default")
    if wrong is None and eng.stats.oom < 1:
        wrong = "no out-of-memory happened under the cap"
    if wrong is None and (limit is None or not limits):
        wrong = "the lane's limit was not lowered"
    return [{"name": "real_oom", "value": f"oom={eng.stats.oom} limit={limit}",
             "target": "same outputs, limit lowered", "status": "PASS" if wrong is None else "FAIL",
             "detail": f"{wrong or 'rows match the uncapped run'}; limits {limits[:6]}; "
                       f"memory cap {frac:.3f} of {total / 2**30:.0f} GiB"}]


def profile_verdict(rc: int, data: dict[str, Any], budget_ms: float) -> str | None:
    """Why a ``worker profile`` run failed (None when it did not): exit 0 is not enough, since a run where
    every batch size failed exits 0 too, recommending none. Wanted: a recommended size whose row ran ("ok")
    within the budget, and no size that failed other than by running out of memory (a small device's
    largest)."""
    if rc != 0:
        return f"worker profile exited {rc}"
    rows = data.get("rows") or []
    if not rows:
        return "no rows in the JSON"
    errors = [r for r in rows if r.get("status") not in ("ok", "oom")]
    if errors:
        return f"batch {errors[0].get('batch_size')}: {errors[0].get('status')}"
    rec = data.get("recommended")
    row = next((r for r in rows if r.get("batch_size") == rec and r.get("status") == "ok"), None)
    if rec is None or row is None:
        return f"recommended {rec}, not a size that ran"
    if row.get("p99_ms") is None or row["p99_ms"] > budget_ms:
        return f"recommended batch {rec} has p99 {row.get('p99_ms')} ms over {budget_ms:g} ms"
    return None


def check_profile_curve(device: str, quick: bool, out_dir: Path) -> list[Result]:
    from worker.app import profile

    png, js = out_dir / "minilm_profile.png", out_dir / "minilm_profile.json"
    for f in (png, js):
        f.unlink(missing_ok=True)  # a previous run's files would pass for this one's
    sizes = "1,4,16" if quick else "1,2,4,8,16,32,64,128,256,512"
    budget = 50.0
    ns = argparse.Namespace(model="minilm", option=[], batch_sizes=sizes, device=device, dtype="fp32",
                            compile=False,
                            latency_budget_ms=budget, iters=3 if quick else 20, warmup=1 if quick else 3,
                            threads=None,
                            plot=str(png), json=str(js))
    rc = profile.run(ns)
    data = json.loads(js.read_text()) if js.exists() else {}
    wrong = profile_verdict(rc, data, budget)
    if wrong is None and not png.exists():
        wrong = f"no plot at {png}"
    return [{"name": "profile_curve", "value": f"recommended {data.get('recommended')}",
             "target": f"p99 <= {budget:g} ms", "status": "PASS" if wrong is None else "FAIL",
             "detail": wrong or f"{png.name}, {js.name}"}]


def null_engine(device: str) -> Engine:
    """minilm with a forward that costs nothing (``tests.bench.null_device``): the host path alone."""
    from tests.bench.null_device import null_minilm

    eng = Engine(null_minilm(), device, warmup=False)
    eng.setup()
    return eng


def feed_items(n: int) -> list[Any]:
    """``n`` distinct texts of the load generator, as the engine takes them (minilm: validated inputs)."""
    from tests.bench.gpu_feed import corpus
    from worker.models.inputs import TextInput

    return [TextInput(text=t) for t in corpus(n)]


def check_feed(device: str, quick: bool) -> list[Result]:
    sizes = [8, 16] if quick else [64, 128, 256, 512, 1024]
    iters = 5 if quick else 30
    dtypes = ["fp16", "bf16"] if device.startswith("cuda") else ["bf16"]  # fp16 autocast is off on CPU
    null = null_engine(device)
    out: list[Result] = []
    for dtype in dtypes:
        eng = engine(device, dtype)
        rates = {bs: bare_throughput(eng, feed_items(bs), iters) for bs in sizes}
        best = max(rates, key=lambda b: rates[b])
        bare = rates[best]
        batches = max(3, iters)
        pipe = pipeline_throughput(eng, feed_items(best), batches)
        ceiling = pipeline_throughput(null, feed_items(best), batches)
        curve = ", ".join(f"{b}: {r:.0f}" for b, r in rates.items())
        out += [
            {"name": f"bare_forward[{dtype}]", "value": round(bare), "target": "info", "status": "INFO",
             "detail": f"items/s at its best batch {best} (of {curve})"},
            {"name": f"pipeline_ratio[{dtype},bs={best}]", "value": round(pipe / bare, 3), "target": ">= 0.9",
             "status": "PASS" if pipe / bare >= 0.9 else "FAIL",
             "detail": f"pipeline {pipe:.0f} items/s, bare forward {bare:.0f} items/s"},
            {"name": f"null_ceiling/bare[{dtype},bs={best}]", "value": round(ceiling / bare, 3),
             "target": "info", "status": "INFO",
             "detail": f"null-device pipeline {ceiling:.0f} items/s, bare forward {bare:.0f}"},
        ]
    return out


def check_generate(device: str, quick: bool) -> list[Result]:
    """The generative step path (``tests/gpu/gpu_generate.py``): greedy agreement per dtype, decode tokens/s,
    and the engines compared on the device, in this one table."""
    from tests.gpu.gpu_generate import run_all as generate_checks

    return generate_checks(device, quick)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="small sizes (a dry run on CPU)")
    ap.add_argument("--out", default=os.environ.get("OUT", "gpu-check-out"),
                    help="folder for the table, curve, plot")
    ap.add_argument("--only", default="", help="comma-separated check names")
    args = ap.parse_args(argv)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("CUDA is not available; use --device cpu for a dry run", file=sys.stderr)
        return 2
    env = f"torch {torch.__version__}"
    if torch.cuda.is_available():
        env += f", {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
    print(f"gpu_check on {args.device} ({env})", flush=True)
    checks: dict[str, Callable[[], list[Result]]] = {
        "minilm_vs_cpu": lambda: check_minilm_vs_cpu(args.device, args.quick),
        "pipeline_ratio": lambda: check_pipeline_ratio(args.device, args.quick),
        "dtype_speedup": lambda: check_dtype_speedup(args.device, args.quick),
        "real_oom": lambda: check_real_oom(args.device, args.quick),
        "profile_curve": lambda: check_profile_curve(args.device, args.quick, out_dir),
        "feed": lambda: check_feed(args.device, args.quick),
        "generate": lambda: check_generate(args.device, args.quick),
    }
    only = {c for c in args.only.split(",") if c}
    results: list[Result] = []
    for name, fn in checks.items():
        if only and name not in only:
            continue
        t = time.perf_counter()
        try:
            rows = fn()
        except Exception as e:
            traceback.print_exc()
            rows = [{"name": name, "value": "-", "target": "-", "status": "FAIL", "detail": repr(e)[:160]}]
        for r in rows:
            r["seconds"] = round(time.perf_counter() - t, 1)
        results.extend(rows)
        print(f"  {name}: {', '.join(r['status'] for r in rows)} ({time.perf_counter() - t:.1f}s)",
              flush=True)
    table = [f"{'check':<28} {'value':<28} {'target':<26} {'status':<6} detail"]
    table += [f"{r['name']:<28} {str(r['value']):<28} {r['target']:<26} {r['status']:<6} {r['detail']}"
              for r in results]
    print("\n".join(table))
    (out_dir / "gpu_check.txt").write_text(f"gpu_check on {args.device} ({env})\n" + "\n".join(table) + "\n")
    (out_dir / "gpu_check.json").write_text(json.dumps({"env": env, "device": args.device,
                                                        "results": results},
                                                       indent=2))
    return 1 if any(r["status"] == "FAIL" for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
