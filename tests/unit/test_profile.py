"""``worker profile`` via run(Namespace): table, recommendation for a latency budget, plot, JSON, errors."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from worker import profile

torch.set_num_threads(1)


def args(**kw: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    profile.add_arguments(parser)
    ns = parser.parse_args([])
    ns.threads = 1
    for k, v in kw.items():
        setattr(ns, k, v)
    return ns


def test_profile_synthetic_prints_table_recommends_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # synthetic costs 2 + 1*n ms: 3, 4, 6, 10, 18 ms for 1..16; throughput grows with n.
    png, js = tmp_path / "curve.png", tmp_path / "rows.json"
    rc = profile.run(args(model="synthetic", option=["a_ms=2", "b_ms=1"], batch_sizes="1,2,4,8,16",
                          device="cpu", latency_budget_ms=14.0, iters=3, warmup=1, plot=str(png), json=str(js)))
    out = capsys.readouterr().out
    assert rc == 0
    assert "batch" in out and "p99 ms" in out and "items/s" in out and "peak MB" in out
    data = json.loads(js.read_text())
    assert [r["batch_size"] for r in data["rows"]] == [1, 2, 4, 8, 16]
    assert data["recommended"] in (4, 8)  # 16 (18 ms) never fits 14 ms; 8 fits unless the box is very busy
    assert f"recommended max_batch_size: {data['recommended']}" in out
    assert png.read_bytes()[:4] == b"\x89PNG"
    rows = data["rows"]
    assert rows[-1]["throughput"] > rows[0]["throughput"]
    assert all(r["peak_mem_mb"] > 0 for r in rows)


def test_profile_tiny_without_budget(capsys: pytest.CaptureFixture[str]) -> None:
    assert profile.run(args(model="tiny", batch_sizes="1,4", device="cpu", iters=2, warmup=0)) == 0
    assert "recommended max_batch_size:" in capsys.readouterr().out


def test_profile_stops_at_oom_and_reports_no_fit(capsys: pytest.CaptureFixture[str]) -> None:
    rc = profile.run(args(model="synthetic", option=["a_ms=0", "b_ms=0", "oom_above=2"], batch_sizes="1,2,4,8",
                          device="cpu", latency_budget_ms=0.0001, iters=2, warmup=0))
    out = capsys.readouterr().out
    assert rc == 0
    assert "oom" in out and "     8 " not in out
    assert "none meets the p99 budget" in out


def test_profile_with_no_size_that_runs_and_no_budget_still_writes_its_json(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    js = tmp_path / "rows.json"
    rc = profile.run(args(model="synthetic", option=["a_ms=0", "b_ms=0", "oom_above=2"], batch_sizes="4,8",
                          device="cpu", iters=2, warmup=0, json=str(js)))
    assert rc == 0
    assert "none; no batch size ran" in capsys.readouterr().out  # was a TypeError formatting budget=None
    assert json.loads(js.read_text())["recommended"] is None


@pytest.mark.parametrize(
    ("kw", "msg"),
    [
        ({"model": "nope"}, "$.model.name: unknown model"),
        ({"batch_sizes": "1,x"}, "--batch-sizes"),
        ({"option": ["novalue"]}, "KEY=VALUE"),
        ({"model": "synthetic", "option": ["bogus=1"]}, "$.model.options.bogus"),
        ({"device": "tpu"}, "$.model.device"),
    ],
)
def test_profile_usage_errors_exit_2(kw: dict[str, object], msg: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert profile.run(args(**kw)) == 2
    assert msg in capsys.readouterr().err


def test_recommend_and_percentile() -> None:
    rows = [profile.Row(1, p99_ms=1, throughput=100), profile.Row(8, p99_ms=5, throughput=700),
            profile.Row(32, p99_ms=20, throughput=900), profile.Row(64, status="oom")]
    assert profile.recommend(rows, 10)
    assert profile.recommend(rows, 10).batch_size == 8  # type: ignore[union-attr]
    assert profile.recommend(rows, None).batch_size == 32  # type: ignore[union-attr]
    assert profile.recommend(rows, 0.5) is None
    assert profile.percentile([1, 2, 3, 4], 0.5) == 2.5
