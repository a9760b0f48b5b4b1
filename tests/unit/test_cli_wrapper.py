"""``bin/worker``, the CLI from a clone, and ``worker --version``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def _wrapper(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    # As a user runs it: from anywhere, no PYTHONPATH of their own.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(ROOT / "bin" / "worker"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_the_wrapper_runs_help_from_any_folder(tmp_path: Path) -> None:
    p = _wrapper("--help", cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("usage: worker")
    for command in ("run", "check-config", "predict", "demo", "backfill"):
        assert f"    {command}" in p.stdout
    assert p.stderr == ""  # the environment exists: its setup says nothing


def test_the_wrapper_prints_the_pyproject_version(tmp_path: Path) -> None:
    p = _wrapper("--version", cwd=tmp_path)
    assert (p.returncode, p.stdout, p.stderr) == (0, f"worker {VERSION}\n", "")


def test_the_wrapper_runs_the_clone_it_lies_in_through_a_symlink(tmp_path: Path) -> None:
    (tmp_path / "worker").symlink_to(ROOT / "bin" / "worker")
    p = subprocess.run([str(tmp_path / "worker"), "--version"], capture_output=True, text=True, timeout=300)
    assert p.stdout == f"worker {VERSION}\n", p.stderr


def test_version_outside_a_clone_is_the_installed_distributions(tmp_path: Path) -> None:
    """Copied out of the clone (no pyproject.toml of this project beside it), the package asks
    importlib.metadata, and without an installed distribution says so rather than guess a number."""
    pkg = tmp_path / "site" / "worker"
    pkg.mkdir(parents=True)
    shutil.copy(ROOT / "worker" / "__init__.py", pkg / "__init__.py")
    (tmp_path / "site" / "pyproject.toml").write_text('[project]\nname = "other"\nversion = "9.9"\n')
    code = ("import importlib.metadata as m, worker\n"
            "try:\n    want = m.version('kafka-inference-worker')\n"
            "except m.PackageNotFoundError:\n    want = '0+unknown'\n"
            "print(worker.__version__, want)")
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env={"PYTHONPATH": str(tmp_path / "site")},
                       capture_output=True, text=True, timeout=60)
    got, want = p.stdout.split()
    assert got == want != "9.9", p.stderr


def test_version_flag_in_process(capsys: pytest.CaptureFixture[str]) -> None:
    from worker.app.cli import main

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"worker {VERSION}\n"
