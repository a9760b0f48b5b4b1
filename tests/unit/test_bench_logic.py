"""The benchmark suite's own arithmetic (no Kafka): verdicts, rates and percentiles, the ideal batcher the
latency figures are compared with, the memory bound and plateau check, and what the stored JSON keeps. A
wrong figure here would misreport every run, so it is checked like product code."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tests.bench import memory
from tests.bench.batching import A_MS, B_MS, ideal
from tests.bench.common import percentile, row, window_rate
from tests.bench.latency import simulate
from tests.bench.run_all import _strip_samples


def test_row_verdicts_follow_the_ratio_and_the_target_direction() -> None:
    assert row("s", "f", 90, "b", 100, ">=", 0.8)["verdict"] == "pass"
    assert row("s", "f", 70, "b", 100, ">=", 0.8)["verdict"] == "MISS"
    assert row("s", "f", 150, "b", 100, "<=", 1.5)["verdict"] == "pass"
    assert row("s", "f", 151, "b", 100, "<=", 1.5)["verdict"] == "MISS"
    assert row("s", "f", 151, "b", 100, "info", 0)["verdict"] == "info"
    # A figure with a target that could not be measured fails (run_all exits 1); it used to read "n/a".
    assert row("s", "f", 1, "b", 0, ">=", 1)["verdict"] == "FAIL"
    assert row("s", "f", 1, "b", float("nan"), ">=", 1)["verdict"] == "FAIL"
    assert row("s", "f", float("nan"), "b", 1, ">=", 1)["verdict"] == "FAIL"
    assert row("s", "f", float("nan"), "b", 1, "info", 0)["verdict"] == "info"
    r = row("s", "f", 3, "b", 4, ">=", 2, "rec/s", "note")
    assert (r["ratio"], r["target"], r["unit"], r["note"]) == (0.75, ">= 2", "rec/s", "note")


def test_percentile_interpolates_and_window_rate_counts_between_quantiles() -> None:
    assert percentile([], 50) != percentile([], 50)  # NaN
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(range(101)), 99) == 99
    # 1000 results, one per ms: 1000/s whatever the window.
    assert window_rate(list(range(1000))) == pytest.approx(1000.0)
    # A slow tail outside the 5-95% window does not count.
    assert window_rate(list(range(1000)) + [10**6] * 10) == pytest.approx(1000.0, rel=0.02)
    assert math.isnan(window_rate([1, 2, 3]))  # too few to say


def test_the_ideal_batcher_serves_what_is_queued_when_free_lanes_unmixed() -> None:
    a_plus_b = A_MS + B_MS
    # Alone: a + b. The second arrives while the first is served and waits for it.
    lat, done = simulate([(0.0, "low"), (1.0, "low")], bs=32, order=("low",))
    assert lat["low"] == [a_plus_b, 2 * a_plus_b - 1.0]
    assert done == [a_plus_b, 2 * a_plus_b]
    # Those queued behind a busy server go together, up to the max batch (2 here).
    lat, _ = simulate([(0.0, "low"), (1.0, "low"), (2.0, "low"), (3.0, "low")], bs=2, order=("low",))
    two = A_MS + 2 * B_MS
    assert lat["low"] == [a_plus_b, a_plus_b + two - 1.0, a_plus_b + two - 2.0,
                          a_plus_b + two + a_plus_b - 3.0]
    # Strict priority between lanes when both are queued.
    lat, _ = simulate([(0.0, "low"), (1.0, "low"), (2.0, "high")], bs=32, order=("high", "low"))
    assert lat["high"] == [a_plus_b - 2.0 + a_plus_b]
    assert lat["low"][1] == 3 * a_plus_b - 1.0
    assert ideal(32) == pytest.approx(32 / ((A_MS + 32 * B_MS) / 1000.0))


def _timeline(rss_kb: list[float], idle_kb: float = 500_000.0) -> dict[str, Any]:
    tl = [{"t": -1.0, "rss_kb": idle_kb, "in_flight": 0.0, "paused": 0.0, "out_total": 0.0}]
    tl += [{"t": float(i), "rss_kb": v, "in_flight": 100.0, "paused": 0.0, "out_total": 600.0 * i}
           for i, v in enumerate(rss_kb)]
    return {"timeline": tl, "load_to_s": float(len(rss_kb) - 1), "bytes_per_in_flight_record": 1000.0}


def _plateau(res: dict[str, Any]) -> dict[str, Any]:
    return next(r for r in memory.summarize(res)["rows"] if r["figure"].startswith("RSS growth"))


def test_memory_bound_and_plateau() -> None:
    # Two RSS levels 8 MB apart, visited in a pattern that moves the median between thirds: a plateau.
    lows_highs = [520_000.0 if i % 3 else 528_000.0 for i in range(30)] + [528_000.0 if i % 3 else 520_000.0
                                                                           for i in range(30)]
    res = _timeline(lows_highs)
    assert _plateau(res)["verdict"] == "pass"
    assert res["rss_median_growth_mid_to_last_third_mb"] > 5.0  # what the median check used to fail on
    # The same levels, both rising by 30 MB over the run (10 MB from one third to the next, the allowance is
    # 1% of max RSS, ~5 MB): growth, whatever the median does.
    rising = [v + i * 30_720.0 / 60 for i, v in enumerate(lows_highs)]
    assert _plateau(_timeline(rising))["verdict"] == "MISS"
    # One sample's spike in the last third is not growth (it read as a miss when the envelope was the highest
    # sample); the same spike held for a quarter of the third is.
    spiked = list(lows_highs)
    spiked[50] = 560_000.0
    assert _plateau(_timeline(spiked))["verdict"] == "pass"
    held = [560_000.0 if 45 <= i < 50 else v for i, v in enumerate(lows_highs)]
    assert _plateau(_timeline(held))["verdict"] == "MISS"
    # The bound: idle + (max_in_flight + poll_max) x bytes per record + the consumer queue + one fetch per
    # partition.
    res = memory.summarize(_timeline([510_000.0] * 10))
    expected_kb = 500_000.0 + ((memory.MAX_IN_FLIGHT + memory.POLL_MAX) * 1000.0 + memory.QUEUED_KB * 1024
                               + memory.PARTITIONS * memory.FETCH_BYTES) / 1024
    assert res["bound_mb"] == pytest.approx(expected_kb / 1024)
    assert res["max_rss_mb"] == pytest.approx(510_000.0 / 1024)
    # Growth over idle against the part of the bound above idle: 10,000 kB of ~24 MB.
    above = [r for r in res["rows"] if r["figure"] == "max RSS above idle, MB"][0]
    assert above["value"] == pytest.approx(10_000 / 1024, abs=1e-3)
    assert above["baseline_value"] == pytest.approx((expected_kb - 500_000.0) / 1024, abs=1e-3)
    # A stored run keeps the settings its bound came from: a re-render does not use today's constants.
    stored = _timeline([510_000.0] * 10)
    stored["bound_inputs"] = {"max_in_flight": 100, "poll_max_records": 0, "queued_kb": 0, "partitions": 0,
                              "fetch_bytes": 0}
    assert memory.summarize(stored)["bound_above_idle_mb"] == pytest.approx(100 * 1000.0 / 1048576)


def test_stored_results_keep_quantiles_not_samples() -> None:
    lane = {"e2e_ms": [float(i) for i in range(1000)], "p99_ms": 990.0}
    scenarios: dict[str, Any] = {
        "latency": {"steps": [{"high": dict(lane), "low": dict(lane), "all": dict(lane)}],
                    "tuned_overload": {"high": dict(lane), "low": dict(lane), "all": dict(lane)},
                    "filled_overload": {"high": dict(lane), "low": dict(lane), "all": dict(lane)}},
        "batching": {"light_load": dict(lane)}}
    _strip_samples(scenarios)
    holders = [*scenarios["latency"]["steps"][0].values(), *scenarios["latency"]["tuned_overload"].values(),
               *scenarios["latency"]["filled_overload"].values(), scenarios["batching"]["light_load"]]
    for h in holders:
        assert "e2e_ms" not in h and len(h["e2e_quantiles_ms"]) == 101
        assert h["e2e_quantiles_ms"][99] == pytest.approx(989.01)


def test_thread_cpu_names_python_threads_and_counts_their_cpu() -> None:
    import threading
    import time

    from tests.bench.profile_worker import _thread_cpu

    done = threading.Event()

    def spin() -> None:
        # Busy until the test has read its CPU (so the thread's own clock ticks; sleeping would not), whenever
        # the loaded machine gets round to that: a fixed amount of spinning could end before the first
        # reading.
        end = time.monotonic() + 10
        while not done.is_set() and time.monotonic() < end:
            pass

    t = threading.Thread(target=spin, name="spinner", daemon=True)
    t.start()
    time.sleep(0.05)
    before = _thread_cpu()
    while t.is_alive() and _thread_cpu().get("spinner", 0.0) - before.get("spinner", 0.0) < 0.05:
        time.sleep(0.02)
    after = _thread_cpu()
    done.set()
    t.join(10)
    assert "spinner" in before and "MainThread" in after
    assert after["spinner"] - before["spinner"] >= 0.05


def test_a_failed_scenario_keeps_a_row_and_fails_the_run(tmp_path: Any,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.bench import run_all

    ok = row("7.5 scale-out", "f", 2.0, "b", 1.0, ">=", 1.8)
    unmeasured = row("7.1 pipeline overhead", "f", float("nan"), "b", 1.0, ">=", 0.8)
    results: dict[str, Any] = {"scenarios": {
        "pipeline": {"rows": [unmeasured]},
        "latency": {"error": "RuntimeError: only 10/20 results on out after 120 s", "rows": []},
        "scaleout": {"rows": [ok], "plot_error": "plot failed: ValueError: x"}}}
    results["table"] = run_all.all_rows(results)
    assert [r["verdict"] for r in results["table"]] == ["FAIL", "ERROR", "pass"]
    assert "only 10/20 results" in results["table"][1]["figure"]
    bad = run_all.failures(results, ["pipeline", "latency", "scaleout"])
    assert len(bad) == 3 and any("plot failed" in b for b in bad)
    # The page's results section is replaced between its markers; the hand-written rest stays.
    page = tmp_path / "benchmarks.md"
    page.write_text(f"# x\n\n{run_all.BEGIN}old table\n{run_all.END}\n\n## GPU\n\nby hand\n")
    monkeypatch.setattr(run_all, "PAGE", page)
    run_all.splice_page("## Results\n\nnew table\n\n")
    want = f"# x\n\n{run_all.BEGIN}## Results\n\nnew table\n{run_all.END}\n\n## GPU\n\nby hand\n"
    assert page.read_text() == want
    # Published row labels say what they measure, not which goal they check.
    assert run_all.label("3 / 7.2 saturated throughput") == "saturated throughput"
    assert run_all.label("7.2 batching vs seeds") == "batching vs other batchers"
    assert run_all.label("seed 000 DynamicBatcher") == "DynamicBatcher"


def _runs(*rates_cpu: tuple[float, float]) -> list[dict[str, Any]]:
    return [{"records_per_s": r, "cpu_us_per_record": c} for r, c in rates_cpu]


def test_pipeline_rows_compare_the_worker_with_each_peer_best_run_against_best_run() -> None:
    from tests.bench import pipeline
    from tests.bench.run_all import label

    res: dict[str, Any] = {"raw_runs": _runs((300_000, 3.5), (400_000, 3.2)),
                           "worker_runs": _runs((120_000, 9.0), (100_000, 8.5)),
                           "quix_runs": _runs((60_000, 16.0), (50_000, 17.0)),
                           "arroyo_runs": _runs((90_000, 11.0), (70_000, 10.0))}
    rows = pipeline.summarize(res)["rows"]
    assert res["worker"]["records_per_s"] == 120_000 and res["raw_cpu_us_per_record"] == 3.2
    rates = [r for r in rows if r["unit"] == "rec/s"]
    assert [(label(r["scenario"]), r["baseline"], r["ratio"], r["target"], r["verdict"]) for r in rates] == [
        ("pipeline overhead", "raw confluent-kafka loop", 0.3, ">= 0.6", "MISS"),
        ("pipeline overhead", "Quix Streams app", 2.0, ">= 2", "pass"),
        ("pipeline overhead", "Sentry Arroyo app", 1.333, ">= 1.5", "MISS")]
    assert all(r["figure"] == "worker records/s (identity, 100 B)" and r["value"] == 120_000 for r in rates)
    assert "arroyo runs: 90,000, 70,000/s" in rates[2]["note"]
    cpu = [r for r in rows if r["unit"] == "us"]
    assert [(r["baseline"], r["value"], r["baseline_value"], r["verdict"]) for r in cpu] == [
        ("raw loop CPU us per record", 8.5, 3.2, "info"),
        ("Quix Streams CPU us per record", 8.5, 16.0, "info"),
        ("Sentry Arroyo CPU us per record", 8.5, 10.0, "info")]
    # A stored run from before Arroyo joined the scenario re-renders with the rows it measured.
    del res["arroyo_runs"], res["arroyo"]
    assert [r["baseline"] for r in pipeline.summarize(res)["rows"]] == [
        "raw confluent-kafka loop", "Quix Streams app", "raw loop CPU us per record",
        "Quix Streams CPU us per record"]


def test_the_arroyo_peer_batches_with_the_worker_lane_limits(tmp_path: Any) -> None:
    from tests.bench import pipeline

    argv = pipeline.peer_argv("arroyo", "b:1", "in", "out", "g", tmp_path)
    assert argv[1:3] == ["-m", "tests.bench.arroyo_app"]
    limits = dict(zip(argv[-4::2], argv[-3::2], strict=True))
    assert limits == {"--batch-size": str(pipeline.LANE["max_batch_size"]),
                      "--batch-time-ms": str(pipeline.LANE["max_wait_ms"])}
    assert "--state-dir" in pipeline.peer_argv("quix", "b:1", "in", "out", "g", tmp_path)


def test_the_arroyo_peer_builds_the_raw_loop_result_for_every_request_of_a_batch() -> None:
    from datetime import datetime

    import msgspec
    from arroyo.backends.kafka import KafkaPayload
    from arroyo.types import BaseValue, BrokerValue, Message, Partition, Topic, Value

    from tests.bench.arroyo_app import results

    part = Partition(Topic("in"), 2)
    now = datetime(2026, 1, 1)
    requests = [KafkaPayload(f"p-{i}".encode(), msgspec.json.encode({"id": f"p-{i}", "inputs": {"v": i}}), [])
                for i in range(3)]
    batch: list[BaseValue[KafkaPayload]] = [BrokerValue(r, part, 10 + i, now) for i, r in enumerate(requests)]
    out = results(Message(Value(batch, {part: 13}, now)))
    assert [v.payload.key for v in out] == [b"p-0", b"p-1", b"p-2"]  # type: ignore[union-attr]
    assert [v.committable for v in out] == [{part: 11}, {part: 12}, {part: 13}]
    assert msgspec.json.decode(out[1].payload.value) == {  # type: ignore[union-attr]
        "id": "p-1", "status": "ok", "outputs": {"v": 1}, "model": "identity",
        "source": {"topic": "in", "partition": 2, "offset": 11}}
