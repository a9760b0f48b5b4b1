"""Runs tests/helm/check_chart.sh (helm lint, render matrix, offline schema validation, check-config).

The first run on a machine builds helm from the Go module proxy (minutes); later runs reuse
~/.cache/kafka-inference-worker/tools/helm-<version> and take seconds. Outside CI a missing tool (go to
build helm, the kubernetes-validate package) skips with the reason; in CI (CI=true) it fails.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# slow: the first run builds helm (minutes on 2 cores); the timeout leaves room for that build.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "check_chart.sh"
HELM_VERSION = os.environ.get("HELM_VERSION", "v3.19.0")
# The cache worker/local/setup_env.sh uses (KIW_CACHE), as check_chart.sh does.
TOOLS = Path(
    os.environ.get("KIW_TOOLS_DIR")
    or Path(os.environ.get("KIW_CACHE") or Path.home() / ".cache" / "kafka-inference-worker") / "tools"
)
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def _missing_tool() -> str | None:
    if shutil.which("bash") is None:
        return "bash is not installed"
    helm = os.environ.get("HELM") or str(TOOLS / f"helm-{HELM_VERSION}" / "helm")
    if not os.access(helm, os.X_OK) and shutil.which("go") is None:
        return f"no helm at {helm} and no Go toolchain to build it"
    for mod in ("kubernetes_validate", "jsonschema", "yaml"):
        if importlib.util.find_spec(mod) is None:
            return f"python module {mod} is not installed (pip install kubernetes-validate)"
    return None


def test_chart_checks() -> None:
    missing = _missing_tool()
    if missing:
        if IN_CI:
            pytest.fail(f"chart checks cannot run in CI: {missing}")
        pytest.skip(missing)
    env = dict(os.environ, PY=sys.executable)
    proc = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True, timeout=1500)
    print(proc.stdout)
    print(proc.stderr, file=sys.stderr)
    assert proc.returncode == 0, ("check_chart.sh exited "
                                  f"{proc.returncode}:\n{proc.stdout[-6000:]}\n{proc.stderr[-3000:]}")
    assert " 0 failed" in proc.stdout
