"""``worker profile``: batch size vs. latency, throughput and memory for one model on one device.

For each batch size it runs ``iters`` synchronous batches (collate -> copy -> forward -> copy back -> split,
after ``warmup`` untimed ones) drawn in turn from the handler's ``example_inputs()`` (built-in sample
sentences of varied length for text models, so padding and length variance show in p99), and reports p50/p99
batch latency, throughput (items/s) and peak memory (CUDA max allocated, or the process's peak RSS). The
recommended ``max_batch_size`` is the size with the highest throughput whose p99 fits ``--latency-budget-ms``
(the highest throughput overall without a budget). Sizes past the first out-of-memory are skipped.

The latencies are those of a lone batch; in the running worker collate overlaps forward, so sustained
throughput is somewhat higher and per-record latency adds the batching wait (``max_wait_ms``).
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any

DEFAULT_SIZES = "1,2,4,8,16,32,64"


@dataclass
class Row:
    batch_size: int
    p50_ms: float = float("nan")
    p99_ms: float = float("nan")
    mean_ms: float = float("nan")
    throughput: float = 0.0  # items/s
    peak_mem_mb: float = float("nan")
    status: str = "ok"  # ok | oom | error: <message> | skipped: <why> (over the model's fixed batch size)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="tiny",
                        help="built-in (tiny, minilm, synthetic, identity), package.module:factory, or a "
                        "model file (default tiny)")
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="model option (repeatable); values are YAML scalars, e.g. --option a_ms=2")
    parser.add_argument("--batch-sizes", default=DEFAULT_SIZES,
                        help=f"comma-separated (default {DEFAULT_SIZES})")
    parser.add_argument("--device", default="auto", help="auto, cpu, mps, cuda or cuda:N (default auto)")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"],
                        help="autocast dtype, as model.dtype (default fp32; fp16 on a CPU runs as fp32)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model's forward")
    parser.add_argument("--latency-budget-ms", type=float, default=None,
                        help="p99 batch latency budget for the recommended max_batch_size (default: none, "
                        "the highest throughput)")
    parser.add_argument("--iters", type=int, default=20, help="timed batches per size (default 20)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed batches per size (default 3)")
    parser.add_argument("--threads", type=int, default=None, help=(
        "torch intra-op threads (default: $WORKER_TORCH_THREADS, else $OMP_NUM_THREADS, else all CPUs but "
        "one on a CPU device)"))
    parser.add_argument("--plot", default=None, metavar="FILE.png",
                        help="draw throughput and latency vs batch size")
    parser.add_argument("--json", default=None, metavar="FILE",
                        help="write the rows and the recommendation as JSON")


def parse_options(pairs: list[str]) -> dict[str, Any]:
    import yaml

    out: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--option expects KEY=VALUE, got {pair!r}")
        out[key.strip()] = yaml.safe_load(value) if value != "" else ""
    return out


def parse_sizes(text: str) -> list[int]:
    try:
        sizes = sorted({int(s) for s in text.split(",") if s.strip()})
    except ValueError:
        raise ValueError(f"--batch-sizes expects comma-separated integers, got {text!r}") from None
    if not sizes or sizes[0] < 1:
        raise ValueError(f"--batch-sizes must be integers >= 1, got {text!r}")
    return sizes


# ------------------------------------------------------------------------------------------------ memory


def _rss_peak_mb() -> float:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024.0 * 1024.0) if sys.platform == "darwin" else peak / 1024.0


def _reset_rss_peak() -> None:
    try:  # Linux: "5" resets the peak RSS (VmHWM) of this process
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _reset_peak(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        _reset_rss_peak()


def _peak_mb(device: str) -> float:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 2**20
    return _rss_peak_mb()


# --------------------------------------------------------------------------------------------- profiling


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    if not s:
        return float("nan")
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def profile_engine(engine: Any, sizes: list[int], iters: int = 20, warmup: int = 3,
                   out: Any = None) -> list[Row]:
    """Measure ``engine.run`` (no recovery) at each batch size; stops at the first OOM."""
    from worker.device.engine import is_oom

    rows: list[Row] = []
    ex = getattr(engine.model, "example_inputs", None)
    pool = engine.example_items(len(ex()) if callable(ex) else 0)
    if not pool:
        raise ValueError(f"model {engine.name} has no example_inputs(); cannot build profiling batches")

    def batch(k: int, bs: int) -> list[Any]:
        # Batch k starts further along the pool, so varied input lengths show up in p50/p99.
        return [pool[(k * bs + j) % len(pool)] for j in range(bs)]

    cap = getattr(engine.model, "max_batch", None)
    for bs in sizes:
        row = Row(bs)
        if cap and bs > cap:
            # A model exported with a fixed batch axis: larger batches are not an option, not an error.
            row.status = f"skipped: the model takes at most {cap} per batch"
            rows.append(row)
            if out is not None:
                print(f"  batch {bs}: {row.status}", file=out)
            continue
        try:
            for k in range(warmup):
                engine.run(batch(k, bs))
            _reset_peak(engine.device)
            lat = []
            for k in range(max(1, iters)):
                items = batch(k, bs)
                t = time.perf_counter()
                engine.run(items)
                lat.append(time.perf_counter() - t)
            row.peak_mem_mb = _peak_mb(engine.device)
        except Exception as e:
            row.status = "oom" if is_oom(e) else f"error: {e!r}"[:200]
            rows.append(row)
            if out is not None:
                print(f"  batch {bs}: {row.status}; stopping", file=out)
            break
        row.p50_ms = percentile(lat, 0.5) * 1e3
        row.p99_ms = percentile(lat, 0.99) * 1e3
        row.mean_ms = statistics.fmean(lat) * 1e3
        row.throughput = bs / statistics.fmean(lat)
        rows.append(row)
    return rows


def profile_steps(model: Any, device: str, sizes: list[int], iters: int = 20, warmup: int = 3,
                  out: Any = None) -> list[Row]:
    """A generative handler: one decode step over ``k`` running sequences per row (``batch_size`` = k, the
    throughput in tokens/s). The sequences are prefilled first (untimed, with the warm-up steps); each is
    started with room for every timed step."""
    from worker.core.step_model import GenParams

    model.setup(device)
    sm = model.step_model()
    prompts = [sm.encode(model.decode(model.input_type(**x)).prompt) for x in model.example_inputs()]
    rows: list[Row] = []
    next_id = 0
    for bs in sizes:
        row = Row(bs)
        ids = list(range(next_id, next_id + bs))
        next_id += bs
        try:
            for k, sid in enumerate(ids):
                sm.start(sid, prompts[k % len(prompts)], GenParams(max_new_tokens=iters + warmup + 1, seed=k))
            _reset_peak(device)
            for _ in range(1 + warmup):  # the first step is the prefill
                sm.step(ids)
            times = []
            for _ in range(iters):
                t = time.perf_counter()
                sm.step(ids)
                times.append(time.perf_counter() - t)
            row.peak_mem_mb = _peak_mb(device)
            ms = [x * 1000.0 for x in times]
            row.p50_ms, row.p99_ms = percentile(ms, 0.5), percentile(ms, 0.99)
            row.mean_ms = statistics.fmean(ms)
            row.throughput = bs / (row.mean_ms / 1000.0)
        except Exception as e:
            row.status = f"error: {type(e).__name__}: {e}"
        finally:
            for sid in ids:
                sm.release(sid)
        rows.append(row)
        if out is not None:
            print(f"  {bs} sequences: p50 {row.p50_ms:.2f} ms per step ({row.status})", file=out)
    return rows


def recommend(rows: list[Row], budget_ms: float | None) -> Row | None:
    """Highest throughput among the sizes whose p99 fits the budget (ties: the smaller size)."""
    ok = [r for r in rows if r.status == "ok" and (budget_ms is None or r.p99_ms <= budget_ms)]
    return max(ok, key=lambda r: (r.throughput, -r.batch_size)) if ok else None


def format_table(rows: list[Row]) -> str:
    lines = [f"{'batch':>7} {'p50 ms':>10} {'p99 ms':>10} {'items/s':>12} {'peak MB':>10}  status"]
    for r in rows:
        lines.append(f"{r.batch_size:>7} {r.p50_ms:>10.2f} {r.p99_ms:>10.2f} {r.throughput:>12.1f} "
                     f"{r.peak_mem_mb:>10.1f}  {r.status}")
    return "\n".join(lines)


def plot(rows: list[Row], path: str, title: str, budget_ms: float | None = None,
         best: Row | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if r.status == "ok"]
    xs = [r.batch_size for r in ok]
    fig, ax1 = plt.subplots(figsize=(7, 4.2))
    ax1.plot(xs, [r.throughput for r in ok], "o-", color="tab:blue", label="throughput")
    ax1.set_xscale("log", base=2)
    ax1.set_xticks(xs, [str(x) for x in xs])
    ax1.set_xlabel("batch size")
    ax1.set_ylabel("items/s", color="tab:blue")
    ax2 = ax1.twinx()
    ax2.plot(xs, [r.p50_ms for r in ok], "s--", color="tab:orange", label="p50 latency")
    ax2.plot(xs, [r.p99_ms for r in ok], "^--", color="tab:red", label="p99 latency")
    ax2.set_ylabel("batch latency (ms)", color="tab:red")
    if budget_ms is not None:
        ax2.axhline(budget_ms, color="gray", linestyle=":", label=f"budget {budget_ms:g} ms")
    if best is not None:
        ax1.axvline(best.batch_size, color="green", alpha=0.4, label=f"recommended {best.batch_size}")
    handles = ax1.get_legend_handles_labels()[0] + ax2.get_legend_handles_labels()[0]
    ax1.legend(handles, [str(h.get_label()) for h in handles], loc="upper left", fontsize=8)
    ax1.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    """The ``worker profile`` command. Exit codes: 0 ok, 2 bad usage/config or a missing extra."""
    from worker.config.settings import ConfigError, ModelConfig

    out = sys.stdout
    budget = getattr(args, "latency_budget_ms", None)
    try:
        sizes = parse_sizes(str(getattr(args, "batch_sizes", DEFAULT_SIZES)))
        options = parse_options(list(getattr(args, "option", None) or []))
        if budget is not None and not (budget > 0 and math.isfinite(budget)):  # (nan passed a <= 0 check)
            raise ValueError(f"--latency-budget-ms must be a finite number > 0, got {budget}")
        iters = int(getattr(args, "iters", 20))
        if iters < 1:
            raise ValueError(f"--iters must be >= 1, got {iters}")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    plot_path = getattr(args, "plot", None)
    for flag, path in (("--json", getattr(args, "json", None)), ("--plot", plot_path)):
        why = _unwritable(path) if path else None
        if why:  # now, not after minutes of profiling
            print(f"error: {flag} {path}: {why}", file=sys.stderr)
            return 2
    if plot_path:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("error: --plot needs matplotlib: pip install 'kafka-inference-worker[plot]'",
                  file=sys.stderr)
            return 2

    from worker.device.engine import Engine
    from worker.models.registry import load_model

    cfg = ModelConfig(name=args.model, options=options, device=getattr(args, "device", "auto"),
                      dtype=getattr(args, "dtype", "fp32"), compile=bool(getattr(args, "compile", False)))
    try:
        model = load_model(cfg)
        engine = Engine(model, cfg.device, dtype=cfg.dtype, compile=cfg.compile, warmup=True,
                        threads=getattr(args, "threads", None))
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if getattr(model, "kind", None) == "generative":
        return _run_generative(model, cfg.device, sizes, iters, int(getattr(args, "warmup", 3)), budget, out)
    engine.setup()
    import torch

    print(f"profiling {engine.name} on {engine.device} ({cfg.dtype}{', compiled' if cfg.compile else ''}, "
          f"{torch.get_num_threads()} torch threads), {iters} batches per size", file=out)
    try:
        rows = profile_engine(engine, sizes, iters=iters, warmup=int(getattr(args, "warmup", 3)), out=out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(format_table(rows), file=out)
    best = recommend(rows, budget)
    if best is None:
        fastest = min((r for r in rows if r.status == "ok"), key=lambda r: r.p99_ms, default=None)
        if fastest is None:  # not one size ran (out of memory, or the model failed): nothing to recommend
            print("recommended max_batch_size: none; no batch size ran (see the status "
                  "column); try smaller ones",
                  file=out)
        else:
            hint = f"; the lowest p99 is {fastest.p99_ms:.2f} ms at batch {fastest.batch_size}"
            print(f"recommended max_batch_size: none meets the p99 budget of {budget:g} ms{hint}", file=out)
    else:
        why = (
            f"p99 {best.p99_ms:.2f} ms <= {budget:g} ms budget"
            if budget is not None
            else "highest throughput"
        )
        print(f"recommended max_batch_size: {best.batch_size} ({why}, {best.throughput:.1f} items/s)",
              file=out)
    if plot_path:
        plot(rows, plot_path, f"{engine.name} on {engine.device} ({cfg.dtype})", budget, best)
        print(f"plot written to {plot_path}", file=out)
    json_path = getattr(args, "json", None)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(
                {
                    "model": engine.name,
                    "device": engine.device,
                    "dtype": cfg.dtype,
                    "rows": [
                        {k: (None if isinstance(v, float) and v != v else v) for k, v in asdict(r).items()}
                        for r in rows
                    ],
                    "recommended": best.batch_size if best else None,
                },
                f,
                indent=2,
            )
    return 0


def _run_generative(model: Any, device: str, sizes: list[int], iters: int, warmup: int, budget: float | None,
                    out: Any) -> int:
    from worker.device.engine import resolve_device

    dev = resolve_device(device)
    print(f"profiling {model.name} on {dev}: one decode step over N running sequences, {iters} steps per N",
          file=out)
    rows = profile_steps(model, dev, sizes, iters=iters, warmup=warmup, out=out)
    print(format_table(rows).replace("batch", "sequences", 1).replace("items/s", "tokens/s", 1), file=out)
    best = recommend(rows, budget)
    if best is None:
        print("recommended model.generation.max_sequences: none (no size ran, or none meets the budget)",
              file=out)
    else:
        why = (
            f"p99 step {best.p99_ms:.2f} ms <= {budget:g} ms budget"
            if budget is not None
            else "highest throughput"
        )
        print(f"recommended model.generation.max_sequences: {best.batch_size} ({why}, "
              f"{best.throughput:.1f} tokens/s)", file=out)
    return 0


def _unwritable(path: str) -> str | None:
    """Why ``path`` cannot be written, or None."""
    import os

    p = os.path.abspath(path)
    if os.path.isdir(p):
        return "is a directory"
    if os.path.exists(p):
        return None if os.access(p, os.W_OK) else "not writable"
    parent = os.path.dirname(p)
    if not os.path.isdir(parent):
        return f"folder {parent} does not exist"
    return None if os.access(parent, os.W_OK) else f"folder {parent} is not writable"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="worker profile", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
