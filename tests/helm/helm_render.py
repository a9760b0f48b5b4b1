"""`helm template` of the chart for the pytest checks in tests/helm, with the helm binary check_chart.sh
builds.

Outside CI a missing helm (none cached in ~/.cache/kafka-inference-worker/tools and no Go toolchain to build
it) skips the test that needs it, with the reason; in CI (CI=true) it fails.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kafka-inference-worker"
HELM_VERSION = os.environ.get("HELM_VERSION", "v3.19.0")
TOOLS = Path(
    os.environ.get("KIW_TOOLS_DIR")
    or Path(os.environ.get("KIW_CACHE") or Path.home() / ".cache" / "kafka-inference-worker") / "tools"
)
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def helm() -> str:
    """The helm binary: $HELM, the cached build, or one built now by check_chart.sh's recipe."""
    path = os.environ.get("HELM") or str(TOOLS / f"helm-{HELM_VERSION}" / "helm")
    if not os.access(path, os.X_OK):
        if shutil.which("go") is None:
            why = f"no helm at {path} and no Go toolchain to build it"
            if IN_CI:
                pytest.fail(why)
            pytest.skip(why)
        proc = subprocess.run(["bash", str(ROOT / "tests" / "helm" / "check_chart.sh"), "--print-helm"],
                              capture_output=True, text=True, timeout=1500)
        assert proc.returncode == 0, f"building helm failed:\n{proc.stderr[-3000:]}"
        path = proc.stdout.strip().splitlines()[-1]
    return path


def render(*args: str) -> list[dict[str, Any]]:
    """The chart's manifests for `helm template kiw <chart> -n inference ARGS...`."""
    proc = subprocess.run([helm(), "template", "kiw", str(CHART), "--namespace", "inference", *args],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def one(docs: list[dict[str, Any]], kind: str, **match: str) -> dict[str, Any]:
    """The one document of ``kind`` (whose metadata.name ends with ``match['suffix']``, if given)."""
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(match.get("suffix", ""))]
    assert len(found) == 1, f"expected one {kind}, got {[d['metadata']['name'] for d in found]}"
    return found[0]
