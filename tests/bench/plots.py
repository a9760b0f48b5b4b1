"""PNG plots from the results dict (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def batch_size(res: dict[str, Any], out: Path) -> Path:
    plt = _plt()
    sweep = res["sweep"]
    bs = [p["max_batch"] for p in sweep]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot(bs, [p["ideal_per_s"] for p in sweep], "k--", label="ideal B/(a+bB)")
    ax1.plot(bs, [p["throughput_per_s"] for p in sweep], "o-", label="worker (saturated)")
    for name, s in res.get("seeds", {}).items():
        ax1.plot([res["main_batch"]], [s["throughput_per_s"]], "s",
                 label=f"seed {name} (B={res['main_batch']})")
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("max batch size")
    ax1.set_ylabel("records/s")
    ax1.set_title(f"Throughput (synthetic a={res['a_ms']:g} ms, b={res['b_ms']:g} ms)")
    ax1.legend(fontsize=8)
    ax2.plot(bs, [p["batch_latency_ms"] for p in sweep], "k--", label="one batch a+bB")
    ax2.plot(bs, [p["e2e_p50_ms"] for p in sweep], "o-", label="worker e2e p50 at 50% load")
    ax2.plot(bs, [p["e2e_p99_ms"] for p in sweep], "o-", label="worker e2e p99 at 50% load")
    if all("ideal_wc_p99_ms" in p for p in sweep):
        ax2.plot(bs, [p["ideal_wc_p99_ms"] for p in sweep], ":",
                 label="ideal work-conserving p99, same arrivals")
    ax2.set_xscale("log", base=2)
    ax2.set_yscale("log")
    ax2.set_xlabel("max batch size")
    ax2.set_ylabel("ms")
    ax2.set_title("Latency")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    path = out / "batch_size.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def latency_cdf(res: dict[str, Any], out: Path) -> Path:
    plt = _plt()
    steps = res["steps"]
    fig, axes = plt.subplots(1, len(steps), figsize=(4 * len(steps), 3.6))
    for ax, st in zip(axes, steps, strict=True):
        for lane, style in (("high", "-"), ("low", "--")):
            xs = st[lane].get("e2e_ms")
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
            else:  # a stored run keeps 101 quantiles instead of every record
                xs = st[lane].get("e2e_quantiles_ms") or []
                ys = [q / 100 for q in range(len(xs))]
            if xs:
                ax.plot(xs, ys, style, label=f"{lane} (p99 {st[lane]['p99_ms']:.0f} ms)")
        ax.set_xscale("log")
        ax.set_title(f"{st['load_pct']}% load")
        ax.set_xlabel("end-to-end ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("fraction of records")
    fig.suptitle("End-to-end latency CDF per lane (high: 10% of traffic, priority 1, weight 4)")
    fig.tight_layout()
    path = out / "latency_cdf.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def overload_timeline(res: dict[str, Any], out: Path) -> Path:
    plt = _plt()
    tl = [x for x in res["timeline"] if "rss_kb" in x]
    t = [x["t"] for x in tl]
    thr = [0.0] + [(b["out_total"] - a["out_total"]) / max(b["t"] - a["t"], 1e-9) for a, b in zip(tl, tl[1:],
                                                                                                  strict=False)]
    has_lag = any("lag" in x for x in tl)  # runs stored before the lag was sampled have no such series
    fig, axes = plt.subplots(5 if has_lag else 4, 1, figsize=(10, 10 if has_lag else 8), sharex=True)
    axes[0].plot(t, [x["in_flight"] for x in tl])
    axes[0].axhline(res["max_in_flight"], color="k", ls="--", lw=0.8, label="max_in_flight")
    axes[0].set_ylabel("in flight\n(worker queue)")
    axes[0].legend(fontsize=8)
    k = 1
    if has_lag:
        axes[k].plot(t, [x.get("lag", float("nan")) for x in tl])
        axes[k].set_ylabel("consumer lag\n(queue in Kafka)")
        k += 1
    axes[k].step(t, [x["paused"] for x in tl], where="post")
    axes[k].set_ylabel("paused partitions")
    axes[k + 1].plot(t, thr)
    axes[k + 1].axhline(res["offered_per_s"] / 10, color="k", ls="--", lw=0.8, label="ideal capacity")
    axes[k + 1].set_ylabel("results/s")
    axes[k + 1].legend(fontsize=8)
    axes[k + 2].plot(t, [x["rss_kb"] / 1024 for x in tl])
    axes[k + 2].axhline(res["bound_mb"], color="r", ls="--", lw=0.8, label="bound")
    axes[k + 2].set_ylabel("RSS MB")
    axes[k + 2].legend(fontsize=8)
    axes[k + 2].set_xlabel(f"seconds (10x overload from 0 to {res['load_to_s']:.0f})")
    for ax in axes:
        ax.axvspan(res["load_from_s"], res["load_to_s"], color="orange", alpha=0.08)
    fig.suptitle("Worker under 10x overload (synthetic, B=32)")
    fig.tight_layout()
    path = out / "overload_timeline.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
