"""The import contracts in pyproject.toml ([tool.importlinter]) hold, and each one fails on what it forbids:
a module of core importing the rest of the worker, an adapter importing the pipeline, an import cycle."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT = ("import sys; from importlinter.cli import lint_imports; "
        "sys.exit(lint_imports(no_cache=True, no_logo=True))")


def _lint(cwd: Path) -> subprocess.CompletedProcess[str]:
    # lint-imports puts its working directory first on sys.path: the worker package it reads is cwd's.
    return subprocess.run([sys.executable, "-c", LINT], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={"PATH": "/usr/bin:/bin"})


def test_the_import_contracts_hold() -> None:
    out = _lint(ROOT)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 broken" in out.stdout


@pytest.fixture(scope="module")
def broken() -> str:
    """lint-imports' report on a copy of the worker with one violation of each contract added."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        copy = Path(tmp)
        shutil.copy(ROOT / "pyproject.toml", copy / "pyproject.toml")
        shutil.copytree(ROOT / "worker", copy / "worker", ignore=shutil.ignore_patterns("__pycache__"))
        (copy / "worker" / "core" / "probe_core.py").write_text("from worker.config.settings import Config\n")
        (copy / "worker" / "kafka" / "probe_adapter.py").write_text("import worker.pipeline.flow\n")
        (copy / "worker" / "probe_a.py").write_text("from worker import probe_b\n")
        (copy / "worker" / "probe_b.py").write_text("def f() -> None:\n    from worker import probe_a\n")
        out = _lint(copy)
    assert out.returncode == 1, out.stdout + out.stderr
    return out.stdout


def test_core_may_not_import_the_rest_of_the_worker(broken: str) -> None:
    assert "worker.core imports nothing else of the worker BROKEN" in broken
    assert "worker.core.probe_core -> worker.config.settings" in broken


def test_an_adapter_may_not_import_the_pipeline(broken: str) -> None:
    assert "worker.kafka.probe_adapter -> worker.pipeline.flow" in broken


def test_a_cycle_fails_even_through_a_function_level_import(broken: str) -> None:
    assert "No import cycles between the modules and packages of a package BROKEN" in broken
    assert ".probe_a" in broken and ".probe_b" in broken
