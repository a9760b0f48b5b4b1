"""GPU checks as tests (marked ``gpu``; skipped without CUDA). tests/gpu/gpu_check.py runs them all with
larger sizes and prints a table."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_minilm_cuda_matches_cpu() -> None:
    from tests.gpu import gpu_check

    for r in gpu_check.check_minilm_vs_cpu("cuda", quick=True):
        assert r["status"] == "PASS", r


def test_pipeline_outputs_match_engine_run() -> None:
    import threading

    from tests.gpu import gpu_check
    from worker.device.engine import DeviceWorker

    eng = gpu_check.engine("cuda")
    items = eng.example_items(24)
    want = eng.run(items)
    batches = [gpu_check.make_batch(items[i : i + 8], i) for i in range(0, 24, 8)]
    got: dict[int, list[object]] = {}
    forward_s: list[float] = []
    finished = threading.Event()

    def take(timeout: float) -> gpu_check.Batch | None:
        return batches.pop(0) if batches else None

    def done(batch: gpu_check.Batch, results: list[object], timings: dict[str, float]) -> None:
        # No assert in here: DeviceWorker logs what its done() raises and goes on, so it could not fail the
        # test.
        got[batch.records[0].offset] = results
        forward_s.append(timings.get("forward", 0.0))
        if len(got) == 3:
            finished.set()

    w = DeviceWorker(eng, take, done)
    w.start()
    assert finished.wait(120)
    assert w.stop(30)
    assert len(forward_s) == 3 and min(forward_s) > 0  # device time from CUDA events, per batch
    flat = got[0] + got[8] + got[16]
    cos = torch.nn.functional.cosine_similarity(torch.tensor(flat), torch.tensor(want), dim=1)
    assert cos.min().item() > 0.9999


def test_real_oom_is_split() -> None:
    from tests.gpu import gpu_check

    (r,) = gpu_check.check_real_oom("cuda", quick=True)
    assert r["status"] == "PASS", r


def test_profile_curve(tmp_path: Path) -> None:
    from tests.gpu import gpu_check

    (r,) = gpu_check.check_profile_curve("cuda", True, tmp_path)
    assert r["status"] == "PASS", r
