"""The hypothesis profiles that set how hard the property tests search (tests/support/props.py)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import settings

from tests.support import props


@pytest.fixture
def restore_profile() -> Iterator[None]:
    loaded = settings.get_profile(settings._current_profile or "default")  # type: ignore[attr-defined]
    yield
    settings.register_profile("_restore", loaded)
    settings.load_profile("_restore")


@pytest.mark.parametrize(("name", "factor"), [("dev", 1), ("ci", 20), ("soak", 1000)])
def test_a_profile_scales_every_tests_examples_and_prints_the_reproducing_blob(
        monkeypatch: pytest.MonkeyPatch, restore_profile: None, name: str, factor: int) -> None:
    monkeypatch.setenv(props.PROFILE_ENV, name)
    assert props.load() == name
    assert settings.default.print_blob is True and settings.default.deadline is None
    assert [props.examples(n) for n in (1, 40, 150)] == [factor, 40 * factor, 150 * factor]


def test_an_unknown_profile_is_an_error_naming_the_variable(monkeypatch: pytest.MonkeyPatch,
                                                             restore_profile: None) -> None:
    monkeypatch.setenv(props.PROFILE_ENV, "fast")
    with pytest.raises(ValueError, match="KIW_HYPOTHESIS_PROFILE='fast': expected one of dev, ci, soak"):
        props.load()


def test_ci_runs_the_ci_profile() -> None:
    ci = (Path(__file__).parents[2] / ".ci" / "run").read_text()
    assert "export KIW_HYPOTHESIS_PROFILE=ci\n" in ci
    assert ci.index("KIW_HYPOTHESIS_PROFILE=ci") < ci.index("\nmake test\n")


def test_the_example_database_is_not_committed() -> None:
    ignored = (Path(__file__).parents[2] / ".gitignore").read_text().split()
    assert ".hypothesis/" in ignored


def test_every_property_test_scales_with_the_profile() -> None:
    # A literal count would not grow under the ci profile (the fuzz smoke keeps its own bounded count).
    tests = Path(__file__).parents[1]
    literal = [f"{p.relative_to(tests)}:{n}" for p in tests.rglob("test_*.py") if "fuzz" not in p.parts
               for n, line in enumerate(p.read_text().splitlines(), 1) if re.search(r"max_examples=\d", line)]
    assert not literal, f"use max_examples=examples(n) (tests/support/props.py): {literal}"
