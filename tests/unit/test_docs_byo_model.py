"""docs/bring-your-own-model.md works as written: its module, config and request through `worker predict`
and `worker check-config` (the commands the page shows), and its Dockerfile's paths."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import msgspec
import pytest

from schemas import Result
from tests.support.doc_blocks import ROOT, commands, titled

PAGE = "docs/bring-your-own-model.md"
FILES = titled(PAGE)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """The page's files, where a reader would write them, and `worker` on PATH as the clone's bin/worker."""
    for name in ("my_model.py", "worker.yaml", "request.json"):
        (tmp_path / name).write_text(FILES[name])
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "worker").symlink_to(ROOT / "bin" / "worker")
    return tmp_path


def _run(command: str, cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run(["bash", "-c", command], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**base, "PATH": f"{cwd / 'bin'}:{os.environ['PATH']}", **env})


def test_the_page_has_every_file_it_talks_about() -> None:
    assert set(FILES) == {"my_model.py", "worker.yaml", "request.json", "result.json", "Dockerfile",
                          "values.yaml"}
    body = [line for line in FILES["my_model.py"].splitlines() if line.strip()]
    assert len(body) <= 10, "the module is meant to fit in ten lines"


def test_the_pages_predict_command_gives_the_result_it_shows(folder: Path) -> None:
    (command,) = [c for c in commands(PAGE, "worker") if c.startswith("worker predict")]
    p = _run(command, folder)
    assert p.returncode == 0, p.stderr
    (line,) = p.stdout.splitlines()
    got = msgspec.json.decode(line, type=Result)
    shown = json.loads(FILES["result.json"])
    request = json.loads(FILES["request.json"])
    assert (got.id, got.status, got.meta) == (request["id"], "ok", request["meta"])
    for key in ("model", "lane", "batch_size", "model_version", "source"):
        assert msgspec.to_builtins(getattr(got, key)) == shown[key], key
    assert set(json.loads(line)) == set(shown)
    assert len(got.outputs) == len(shown["outputs"]) == 3
    assert [round(x, 4) for x in got.outputs] == shown["outputs"]  # the seed fixes the weights


def test_a_request_of_another_shape_gets_the_error_the_page_quotes(folder: Path) -> None:
    p = _run("""worker predict --config worker.yaml --input '{"id": "r", "inputs": [1, 2, 3]}'""", folder)
    assert p.returncode == 1
    error = json.loads(p.stdout)["error"]
    assert error in (ROOT / PAGE).read_text()


def test_the_pages_check_config_command_passes_and_catches_an_option_typo(folder: Path) -> None:
    (command,) = [c for c in commands(PAGE, "worker") if c.startswith("worker check-config")]
    p = _run(command, folder)
    assert p.returncode == 0, p.stderr
    (folder / "worker.yaml").write_text(FILES["worker.yaml"].replace("in_features:", "in_feature:"))
    p = _run(command, folder)
    assert p.returncode == 2
    assert "did you mean `in_features`?" in p.stderr


def test_the_dockerfile_copies_the_module_onto_its_pythonpath(tmp_path: Path) -> None:
    """What the image does, laid out here: the module in the folder the Dockerfile copies it to, found through
    the PYTHONPATH it sets, from the image's working folder (/tmp)."""
    docker = FILES["Dockerfile"]
    base = re.search(r"^FROM (\S+)$", docker, re.M)
    assert base and base[1].startswith("kafka-inference-worker:")
    assert "ENTRYPOINT" not in docker  # the base image's entrypoint (worker) stays
    copy = re.search(r"^COPY (?:--\S+ )*my_model\.py (\S+)/$", docker, re.M)
    path = re.search(r"^ENV PYTHONPATH=(\S+)$", docker, re.M)
    assert copy and path and copy[1] == path[1]
    image_root = tmp_path / "image"
    models = image_root / copy[1].lstrip("/")
    models.mkdir(parents=True)
    (models / "my_model.py").write_text(FILES["my_model.py"])
    (tmp_path / "worker.yaml").write_text(FILES["worker.yaml"])
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    p = subprocess.run([str(ROOT / "bin" / "worker"), "check-config", "--config",
                        str(tmp_path / "worker.yaml")],
                       cwd=workdir, capture_output=True, text=True, timeout=300,
                       env={**env, "PYTHONPATH": str(models)})
    assert p.returncode == 0, p.stderr
