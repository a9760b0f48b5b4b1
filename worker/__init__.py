"""kafka-inference-worker: Kafka -> micro-batches -> PyTorch -> Kafka, committing only what was delivered."""

from __future__ import annotations

import re
from pathlib import Path

DIST_NAME = "kafka-inference-worker"


def _version() -> str:
    """The version of the code that runs: a clone's pyproject.toml when this package lies in one (the clone's
    code runs from PYTHONPATH, whatever an environment has installed), else the installed distribution's."""
    pyproject = Path(__file__).resolve().parent.parent / "pyproject.toml"
    try:
        text = pyproject.read_text(encoding="utf-8")
    except OSError:
        text = ""
    project = re.search(r"^\[project\]\n(.*?)(?=^\[|\Z)", text, re.M | re.S)
    if project and re.search(rf'^name = "{DIST_NAME}"$', project[1], re.M):
        found = re.search(r'^version = "([^"]+)"$', project[1], re.M)
        if found:
            return found[1]
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(DIST_NAME)
    except PackageNotFoundError:
        return "0+unknown"


__version__ = _version()
