"""tests/gpu/gpu_generate.py imports and its CPU smoke run passes (the CUDA run needs a GPU machine)."""

from __future__ import annotations

import pytest


def test_the_cpu_smoke_run_passes(capsys: pytest.CaptureFixture[str]) -> None:
    from tests.gpu import gpu_generate

    assert gpu_generate.main(["--cpu"]) == 0
    out = capsys.readouterr().out
    assert "greedy_match fp32" in out and "PASS" in out and "FAIL" not in out
    for check in ("step_tokens_s smoke fp32 x8", "engines step-model-16", "engines hf-static-16"):
        assert check in out
