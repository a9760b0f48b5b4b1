"""The documentation site (mkdocs.yml + docs/) and README: every page is in the nav and the strict build
passes, the configuration reference is what the config Structs generate, README stays short and its links
resolve, and user pages keep to the user's voice."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from markdown.extensions.toc import slugify

from tests.support import config_reference
from tests.support.readme import DOCS, README, ROOT

# Pages where measured figures (and how runs went) belong; user pages state what the worker does.
FIGURE_PAGES = {"benchmarks.md", "chaos.md", "design-notes.md"}


def _nav_pages(nav: list[Any]) -> list[str]:
    out: list[str] = []
    for item in nav:
        value = next(iter(item.values())) if isinstance(item, dict) else item
        out += _nav_pages(value) if isinstance(value, list) else [value]
    return out


def _pages() -> set[str]:
    return {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}


def test_every_page_is_in_the_nav_and_every_nav_entry_exists() -> None:
    nav = _nav_pages(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    assert len(nav) == len(set(nav)), "a page is listed twice in mkdocs.yml's nav"
    assert sorted(_pages() - set(nav)) == [], "pages missing from mkdocs.yml's nav"
    assert sorted(set(nav) - _pages()) == [], "nav entries without a page"


def test_the_site_builds_strict(tmp_path: Path) -> None:
    # --strict: a broken link or anchor, or a page outside the nav, fails the build (mkdocs.yml `validation`).
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir",
                          str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                         env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"}, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert (tmp_path / "site" / "config-reference" / "index.html").exists()


def test_the_configuration_reference_is_what_the_config_structs_generate() -> None:
    assert config_reference.PAGE.read_text() == config_reference.render(), (
        "docs/config-reference.md is stale: run python -m tests.support.config_reference")


def test_the_configuration_reference_lists_every_config_key() -> None:
    page = config_reference.PAGE.read_text()
    rows = set(re.findall(r"^\| `([a-z_.\[\]]+)` \|", page, re.M))
    keys = {key for key, *_ in config_reference.fields()}
    assert keys and rows == keys


def test_a_config_key_without_a_meaning_fails_the_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    meanings = dict(config_reference.MEANINGS)
    del meanings["kafka.group_id"]
    monkeypatch.setattr(config_reference, "MEANINGS", meanings)
    with pytest.raises(SystemExit, match=r"missing \['kafka.group_id'\]"):
        config_reference.render()


def _anchors(page: Path) -> set[str]:
    """The heading ids MkDocs gives a page (toc's slugify of the heading text, code marks dropped)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slugify(re.sub(r"[`*]", "", h).strip(), "-") for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_readme_is_short_and_its_links_resolve() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links
    broken = []
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        path, _, anchor = link.partition("#")
        target = ROOT / path
        if not target.exists() or (anchor and anchor not in _anchors(target)):
            broken.append(link)
    assert broken == []


def test_readme_model_example_is_the_one_the_models_page_runs() -> None:
    # test_models.py runs the Models page's example; README shows the same code, so it cannot drift.
    readme = re.search(r"```python\n(.*?)```", README.read_text(), re.S)
    page = re.search(r"```python\n(.*?)```", (DOCS / "models.md").read_text(), re.S)
    assert readme and page and readme.group(1) == page.group(1)


def test_readme_keeps_the_test_command_ci_runs() -> None:
    # .ci/run runs `make test`; README says so, next to the command.
    assert "make test" in (ROOT / ".ci" / "run").read_text().splitlines()[-1]
    assert re.search(r"CI runs exactly `make test`", README.read_text())


@pytest.mark.parametrize("page", sorted(_pages() - FIGURE_PAGES))
def test_user_pages_speak_to_the_user(page: str) -> None:
    text = (DOCS / page).read_text()
    for pattern in (r"\bI (ran|looked|measured|think)\b", r"\bat commit\b", r"\bin \d+ (of \d+ )?runs\b",
                    r"\bruns? of \d+\b", r"\bissue \d+\b"):
        assert not re.search(pattern, text), f"{page}: {pattern!r} (lab notes go in design-notes.md)"


def test_every_module_the_architecture_page_names_exists() -> None:
    text = (DOCS / "architecture.md").read_text()
    packages = sorted(d.name for d in (ROOT / "worker").iterdir() if (d / "__init__.py").is_file())
    named = set(re.findall(rf"`((?:worker/)?(?:{'|'.join(packages)})/[a-z_]+\.py)`", text))
    assert len(named) > 20
    missing = sorted(
        n for n in named if not (ROOT / (n if n.startswith("worker/") else f"worker/{n}")).exists()
    )
    assert not missing, f"docs/architecture.md names modules that do not exist: {missing}"
    anywhere = {p.name for p in (ROOT / "worker").rglob("*.py")}
    unknown = sorted(set(re.findall(r"`([a-z_]+\.py)`", text)) - anywhere)
    assert not unknown, f"docs/architecture.md names modules that do not exist: {unknown}"
    # The handlers of models/ and the launchers of local/ have pages of their own.
    listed = {
        p.relative_to(ROOT).as_posix()
        for d in packages if d not in ("models", "local")
        for p in (ROOT / "worker" / d).glob("*.py")
        if p.name != "__init__.py"
    }
    unnamed = sorted(m for m in listed if m.split("/", 1)[1] not in text and m.rsplit("/", 1)[1] not in text)
    assert not unnamed, f"modules the architecture page does not name: {unnamed}"
