"""worker/core stays pure: no I/O libraries, no threads, no clocks (time comes in as ``now``)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "worker" / "core"
BANNED = {
    "confluent_kafka", "torch", "redis", "prometheus_client",  # adapters' business
    "threading", "_thread", "multiprocessing", "concurrent", "asyncio",  # no threads or loops
    "time",  # no clocks and no sleeping: ``now`` is an argument
}
BANNED_CALLS = {"sleep", "monotonic", "perf_counter", "time_ns", "monotonic_ns", "__import__",
                "import_module"}


def _modules() -> list[Path]:
    found = sorted(CORE.rglob("*.py"))
    assert found, f"no modules under {CORE}"
    return found


def _violations(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""] if node.level == 0 else []
        elif isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
            if name in BANNED_CALLS:
                bad.append(f"{path.name}:{node.lineno}: calls {name}()")
            continue
        else:
            continue
        for n in names:
            if n.split(".")[0] in BANNED:
                bad.append(f"{path.name}:{node.lineno}: imports {n}")
    return bad


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.name)
def test_core_module_is_pure(path: Path) -> None:
    assert _violations(path) == []


def test_checker_catches_violations(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import time\nfrom confluent_kafka import Consumer\nimport torch.nn as nn\n"
                   "from threading import Thread\nfrom . import records\nx = time.monotonic()\n")
    found = _violations(bad)
    assert len(found) == 5, found
    assert not any("records" in v for v in found)  # relative imports are core-internal


def test_importing_core_pulls_in_no_heavy_dependency() -> None:
    code = (
        "import sys, importlib, pkgutil, worker.core as c\n"
        "for m in pkgutil.iter_modules(c.__path__): importlib.import_module('worker.core.' + m.name)\n"
        "print(','.join(sorted(n for n in ('torch','confluent_kafka','redis','prometheus_client') if n in "
        "sys.modules)))\n"
    )
    root = str(CORE.parents[1])
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root,
                         env={"PYTHONPATH": root}, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""
