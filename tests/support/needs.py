"""What a test needs besides Kafka and Redis (an optional package, a command): outside CI a missing one skips
the test with the reason; in CI (CI=true), where ``make test``'s setup installs every extra, it fails it. A
silent skip in CI would pass a run that never checked the thing."""

from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType

import pytest

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def missing(why: str) -> None:
    if IN_CI:
        pytest.fail(f"{why} (CI=true: a test never skips for a missing dependency)", pytrace=False)
    pytest.skip(why, allow_module_level=True)  # also from a module body (a module that needs a package)


def module(name: str) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        missing(f"python module {name} is not installed: {e}")
        raise  # unreachable: missing() raises


def command(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        missing(f"the {name} command is not installed")
        raise AssertionError  # unreachable: missing() raises
    return path
