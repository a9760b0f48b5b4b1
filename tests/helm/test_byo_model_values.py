"""docs/bring-your-own-model.md's Helm values render with the chart (helm template, validated offline as
tests/helm/check_chart.sh validates), and the worker config they render runs the page's model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.helm.test_chart import HELM_VERSION, IN_CI, TOOLS, _missing_tool
from tests.support.doc_blocks import ROOT, titled

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

HERE = Path(__file__).resolve().parent
CHART = ROOT / "helm" / "kafka-inference-worker"
FILES = titled("docs/bring-your-own-model.md")


def _helm() -> str:
    missing = _missing_tool()
    if missing:
        if IN_CI:
            pytest.fail(f"the chart cannot be rendered in CI: {missing}")
        pytest.skip(missing)
    helm = os.environ.get("HELM") or str(TOOLS / f"helm-{HELM_VERSION}" / "helm")
    if not os.access(helm, os.X_OK):
        # check_chart.sh builds helm once into the shared cache (ensure_helm); run it for that.
        subprocess.run(["bash", str(HERE / "check_chart.sh")], env=dict(os.environ, PY=sys.executable),
                       capture_output=True, text=True, timeout=1500)
    assert os.access(helm, os.X_OK), f"no helm at {helm}"
    return helm


def test_the_pages_values_render_and_their_config_runs_the_pages_model(tmp_path: Path) -> None:
    helm = _helm()
    values = tmp_path / "values.yaml"
    values.write_text(FILES["values.yaml"])
    rendered = tmp_path / "rendered.yaml"
    p = subprocess.run([helm, "template", "scoring", str(CHART), "--namespace", "inference", "--kube-version",
                        "1.30.0", "-f", str(values)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    rendered.write_text(p.stdout)
    config = tmp_path / "config.yaml"
    p = subprocess.run([sys.executable, str(HERE / "validate_manifests.py"), "--kube-version", "1.30.0",
                        "--extract-config", str(config), str(rendered)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout + p.stderr

    docs = [d for d in yaml.safe_load_all(rendered.read_text()) if d]
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "worker"]
    wanted = yaml.safe_load(FILES["values.yaml"])
    assert container["image"] == f"{wanted['image']['repository']}:{wanted['image']['tag']}"
    cfg = yaml.safe_load(config.read_text())
    assert cfg["model"] == {**cfg["model"], **wanted["config"]["model"]}

    # The image puts the module on PYTHONPATH (the page's Dockerfile); here a folder stands in for it.
    models = tmp_path / "models"
    models.mkdir()
    (models / "my_model.py").write_text(FILES["my_model.py"])
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, "PYTHONPATH": str(models)}
    worker = str(ROOT / "bin" / "worker")
    p = subprocess.run([worker, "check-config", "--config", str(config)], capture_output=True, text=True,
                       timeout=300, env=env, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    p = subprocess.run([worker, "predict", "--config", str(config), "--device", "cpu", "--input",
                        FILES["request.json"]], capture_output=True, text=True, timeout=300, env=env,
                       cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    result = yaml.safe_load(p.stdout)
    assert (result["status"], result["model_version"]) == ("ok", wanted["config"]["model"]["version"])
