"""``make bench`` = ``python -m tests.bench.run_all [--only NAME[,NAME]] [--quick] [--out DIR]``.

Runs the benchmark scenarios against one Kafka broker ($KAFKA_BOOTSTRAP_SERVERS, else a local one it starts),
prints one table (scenario, figure, baseline, ratio, target, verdict) and writes ``results.json`` and PNG
plots to ``docs/bench/``. Only a full run writes there: ``--quick`` (smaller counts) and ``--only`` write to
/tmp/kiw-bench-quick and /tmp/kiw-bench-only unless --out is given, so the published table is always one run
of every scenario, never rows picked from several. A full run also rewrites the results section of
``docs/benchmarks.md`` (between its ``<!-- results: begin -->`` and ``<!-- results: end -->`` markers; the
rest of the page is written by hand).
Every figure is a ratio against a baseline measured in the same run; nothing here asserts on time. The exit
status is 1 when a scenario or a plot failed, or a figure with a target could not be measured (verdict FAIL).

Scenarios: pipeline (7.1), batching (3, 7.2: sweep, seeds, 10% load), realmodel (7.3), latency (3, 7.4),
scaleout (7.5), memory (7.6), token_budget (token budget vs count-only batching), gpu_feed (27),
generative (issue 28: continuous vs static batching).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from tests.bench import (
    batching,
    generative,
    gpu_feed,
    latency,
    memory,
    pipeline,
    plots,
    realmodel,
    scaleout,
    token_budget,
)
from tests.bench.common import ROOT, Broker, Ctx, log, percentile, workdir

SCENARIOS = {"pipeline": pipeline, "batching": batching, "realmodel": realmodel, "latency": latency,
             "scaleout": scaleout, "memory": memory, "token_budget": token_budget, "gpu_feed": gpu_feed,
             "generative": generative}
# Describes the machine in the results section; e.g. KIW_BENCH_MACHINE="2-core shared VM, CPU only".
MACHINE = os.environ.get("KIW_BENCH_MACHINE") or f"{os.cpu_count()}-core machine, CPU only"
PAGE = ROOT / "docs" / "benchmarks.md"
# The generated part of the page lies between these two markers.
BEGIN, END = "<!-- results: begin (written by python -m tests.bench.run_all) -->\n", "<!-- results: end -->"
# The scenarios' row labels carry the numbers of the performance goals they check ("7.1", "3 / 7.2"); the
# published table names what a row measures instead.
_GOAL_NUMBERS = re.compile(r"^(?:\d+(?:\.\d+)?\s*/\s*)*\d+(?:\.\d+)?\s+")
_LABEL_WORDS = (("batching vs seeds", "batching vs other batchers"), ("seed 000 ", ""), ("seed 003 ", ""))


def git_commit() -> str:
    """The code measured: HEAD, with "+changes" when tracked files other than the bench outputs differ."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True,
                              check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                  ":!docs/bench", ":!docs/benchmarks.md"], cwd=ROOT,
                                 capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head + ("+changes" if changed else "")


def _fmt(x: Any) -> str:
    if isinstance(x, float):
        if x != x:
            return "n/a"
        return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.3g}" if abs(x) < 10 else f"{x:.1f}"
    return str(x)


def label(text: str) -> str:
    """A row label as published: what it measures, without the goal numbers ("7.2 batching vs seeds")."""
    text = _GOAL_NUMBERS.sub("", text)
    for old, new in _LABEL_WORDS:
        text = text.replace(old, new)
    return text


def table(rows: list[dict[str, Any]]) -> list[str]:
    head = ["scenario", "figure", "value", "baseline", "baseline value", "ratio", "target", "verdict"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        out.append("| " + " | ".join([label(r["scenario"]), r["figure"], _fmt(r["value"]),
                                      label(r["baseline"]),
                                      _fmt(r["baseline_value"]),
                                      f"{r['ratio']:.2f}" if r["ratio"] == r["ratio"]
                                      else "n/a", r["target"], r["verdict"]]) + " |")
    return out


def lane_table(lat: dict[str, Any]) -> list[str]:
    out = ["| load | offered/s | high served | high p50 | high p99 | low served | low p50 | low p99 | all "
           "p99 | ideal p99 | mean batch |", "|---|---|---|---|---|---|---|---|---|---|---|"]

    def served(x: dict[str, Any]) -> str:
        return f"{x['n']:,}/{x['sent_in_window']:,}" if "sent_in_window" in x else "-"

    for st in lat["steps"]:
        h, lo = st["high"], st["low"]
        out.append(f"| {st['load_pct']}% | {st['rate_per_s']:.0f} | {served(h)} | {h['p50_ms']:.0f} ms | "
                   f"{h['p99_ms']:.0f} ms | {served(lo)} | {lo['p50_ms']:.0f} ms | {lo['p99_ms']:.0f} ms | "
                   f"{st['all']['p99_ms']:.0f} ms | {st['ideal_wc_p99_ms']:.0f} ms | "
                   f"{st['all']['mean_batch']:.1f} |")
    return out


def _strip_samples(res: dict[str, Any]) -> None:
    """Keep the JSON small: per-record latency lists become 101 quantiles."""
    for key in ("latency", "batching"):
        sc = res.get(key)
        if not isinstance(sc, dict):
            continue
        steps = sc.get("steps", []) + [sc[k] for k in ("tuned_overload", "filled_overload",
                                                       "heavy_high_overload") if k in sc]
        holders = [st[lane] for st in steps for lane in ("high", "low", "all")]
        holders += [sc[k] for k in ("light_load", "light_load_b8") if k in sc]
        for h in holders:
            xs = h.pop("e2e_ms", None)
            if xs:
                h["e2e_quantiles_ms"] = [round(percentile(xs, q), 2) for q in range(101)]


def _runs_line(results: dict[str, Any]) -> str:
    runs = results.get("runs") or [{"command": results["command"], "runtime_s": results["runtime_s"],
                                    "scenarios": list(SCENARIOS)}]
    parts = []
    for r in runs:
        what = "" if set(r["scenarios"]) == set(SCENARIOS) else f"; {', '.join(r['scenarios'])} rows"
        parts.append(f"`{r['command']}` ({r['runtime_s'] / 60:.1f} min{what})")
    return ", then ".join(parts)


def write_page(results: dict[str, Any]) -> None:
    sc = results["scenarios"]
    lines = [
        "## Results",
        "",
        f"Measured {results['date']} on a {results['machine']} (figures are noisy, so every "
        "one is a ratio against",
        f"a baseline measured in the same run), with a local single-node Kafka broker "
        f"({results.get('broker_storage', 'data on disk')}), by one run of",
        f"{_runs_line(results)} at commit `{results.get('commit', 'unknown')}`.",
        "",
        *table(results["table"]),
        "",
        "Targets are the project's performance goals; `info` rows have none. Synthetic model: `a + b*n`",
        "per batch with a = 20 ms, b = 1 ms (it sleeps, releasing the GIL as a GPU wait does), so the ideal",
        "saturated rate at max batch 32 is 32 / 52 ms = 615 records/s. End-to-end latency is the result's",
        "`timings.e2e_ms` (result time - request Kafka timestamp). \"Ideal\" latency figures come from",
        "simulating a perfect work-conserving batcher (one queue, lanes mixed, takes up to 32 queued records",
        "whenever it is free, service a + b*n, no Kafka) on the very same arrival times: what batching alone",
        "allows at that load.",
        "",
    ]
    if "latency" in sc and "steps" in sc["latency"]:
        lines += ["Latency per lane (two lanes: `high` 10% of traffic, priority 1, weight 4; `low` weight "
                  "1). Latencies",
                  "are of the records served (\"served\": results of the records sent after the first "
                  "seconds of the",
                  "step); under overload the low lane's backlog is not served before the worker "
                  "stops, and the ideal",
                  "p99 then counts only what the ideal batcher would have finished by the "
                  "worker's last result:", "",
                  *lane_table(sc["latency"]), ""]
    lines += [
        "Plots: [throughput and latency vs batch size](bench/batch_size.png),",
        "[latency CDF per lane](bench/latency_cdf.png),",
        "[overload timeline](bench/overload_timeline.png) (in-flight records, consumer lag, paused",
        "partitions, results/s and RSS under 10x overload); every figure in",
        "[`bench/results.json`](bench/results.json).",
        "",
    ]
    splice_page("\n".join(lines))


def splice_page(section: str) -> None:
    """The page's results section = ``section``, between the markers; the hand-written rest stays."""
    page = PAGE.read_text()
    start, end = page.find(BEGIN), page.find(END)
    if start < 0 or end < start:
        raise RuntimeError(f"{PAGE} has no {BEGIN.strip()!r} ... {END!r} markers")
    PAGE.write_text(page[:start + len(BEGIN)] + section.rstrip("\n") + "\n" + page[end:])


def draw(name: str, res: dict[str, Any], out: Path) -> str | None:
    """Draw the scenario's plot; the error text if that failed (the run then fails: an old PNG would stay)."""
    try:
        if name == "batching" and "sweep" in res:
            plots.batch_size(res, out)
        elif name == "latency" and "steps" in res:
            plots.latency_cdf(res, out)
        elif name == "memory" and "timeline" in res:
            plots.overload_timeline(res, out)
    except Exception as e:
        traceback.print_exc()
        return f"plot failed: {type(e).__name__}: {e}"
    return None


def error_row(name: str, msg: str) -> dict[str, Any]:
    """A failed scenario keeps a line in the table, so that its figures do not just disappear."""
    return {"scenario": name, "figure": f"scenario failed: {msg}"[:200], "value": float("nan"), "unit": "",
            "baseline": "-", "baseline_value": float("nan"), "ratio": float("nan"), "target": "-",
            "verdict": "ERROR", "note": ""}


def all_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for n in SCENARIOS:
        res = results["scenarios"].get(n)
        if res is None:
            continue
        rows += res.get("rows", [])
        if "error" in res:
            rows.append(error_row(n, res["error"]))
    return rows


def failures(results: dict[str, Any], names: list[str]) -> list[str]:
    out = [f"{n}: {results['scenarios'][n]['error']}" for n in names if "error" in results["scenarios"][n]]
    out += [
        f"{n}: {results['scenarios'][n]['plot_error']}"
        for n in names
        if "plot_error" in results["scenarios"][n]
    ]
    out += [f"{r['scenario']} / {r['figure']}: not measured (verdict FAIL)" for r in results["table"]
            if r["verdict"] == "FAIL"]
    return out


def rerender(out: Path, page: bool) -> int:
    """Same measurements, summaries recomputed by the current code (scenarios with a ``summarize``)."""
    path = out / "results.json"
    results = json.loads(path.read_text())
    for name, res in results["scenarios"].items():
        summarize = getattr(SCENARIOS[name], "summarize", None)
        if summarize is not None and "error" not in res:
            summarize(res)
        err = draw(name, res, out)
        if err:
            res["plot_error"] = err
        else:
            res.pop("plot_error", None)
    _strip_samples(results["scenarios"])  # a stored run from before a scenario's samples were stripped
    results["table"] = all_rows(results)
    path.write_text(json.dumps(results, indent=1, sort_keys=True, default=str))
    print("\n".join(table(results["table"])))
    if page and out == ROOT / "docs" / "bench":
        write_page(results)
    bad = failures(results, list(results["scenarios"]))
    for line in bad:
        print(f"FAILED {line}")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.bench.run_all", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(SCENARIOS)}")
    ap.add_argument("--quick", action="store_true", help="smaller counts (about 5 minutes)")
    ap.add_argument("--out", default=None,
                    help="output folder (default: docs/bench for a full run, /tmp/kiw-bench-quick with "
                         "--quick, /tmp/kiw-bench-only with --only)")
    ap.add_argument("--no-page", action="store_true",
                    help="do not rewrite the results section of docs/benchmarks.md")
    ap.add_argument("--rerender", action="store_true",
                    help="measure nothing: rebuild the table, plots and the page's results section from the "
                         "stored results.json")
    args = ap.parse_args(argv)
    if args.rerender:
        return rerender(Path(args.out) if args.out else ROOT / "docs" / "bench", not args.no_page)
    names = list(SCENARIOS) if not args.only else [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        ap.error(f"unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}")
    default_out = (Path("/tmp/kiw-bench-quick") if args.quick else Path("/tmp/kiw-bench-only") if args.only
                   else ROOT / "docs" / "bench")
    out = Path(args.out) if args.out else default_out
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    results: dict[str, Any] = {"scenarios": {}, "commit": git_commit()}
    t0 = time.monotonic()
    work = workdir()
    log(f"benchmarks {names} ({'quick' if args.quick else 'full'}); logs in {work}; output in {out}")
    with Broker() as broker:
        ctx = Ctx(broker.bootstrap, work, args.quick)
        for name in names:
            t = time.monotonic()
            try:
                res = SCENARIOS[name].run(ctx)
            except Exception as e:  # one broken scenario must not lose the others
                traceback.print_exc()
                res = {"error": f"{type(e).__name__}: {e}", "rows": []}
            res["wall_s"] = round(time.monotonic() - t, 1)
            log(f"{name} done in {res['wall_s']:.0f}s")
            err = draw(name, res, out)
            if err:
                res["plot_error"] = err
            results["scenarios"][name] = res
            _strip_samples(results["scenarios"])
    runtime = time.monotonic() - t0
    cmd = "make bench" if not args.only and not args.quick else "python -m tests.bench.run_all " + " ".join(
        (["--quick"] if args.quick else []) + ([f"--only {args.only}"] if args.only else []))
    today = time.strftime("%Y-%m-%d", time.gmtime())
    runs = [{"command": cmd, "runtime_s": round(runtime, 1), "scenarios": names, "date": today}]
    results.update({"date": today, "machine": MACHINE, "broker_storage": broker.storage,
                    "python": sys.version.split()[0],
                    "platform": platform.platform(), "quick": args.quick, "command": cmd,
                    "runtime_s": round(runtime, 1), "last_run_scenarios": names, "runs": runs})
    results["table"] = all_rows(results)
    results_path.write_text(json.dumps(results, indent=1, sort_keys=True, default=str))
    print()
    print("\n".join(table(results["table"])))
    print(f"\ntotal {runtime / 60:.1f} min; results in {results_path} (commit {results['commit']})")
    if not args.quick and not args.only and not args.no_page and out == ROOT / "docs" / "bench":
        write_page(results)
        print(f"results section written to {PAGE}")
    bad = failures(results, names)
    for line in bad:
        print(f"FAILED {line}")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
