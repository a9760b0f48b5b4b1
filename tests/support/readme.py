"""The documentation pages that tests check against the code (metrics table, config example, Redis keys,
the custom model example). Each topic the tests name lives on one page of the site under ``docs/``."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

# Topic -> the page that holds it.
PAGES = {
    "quickstart": "getting-started.md",
    "configuration": "config-reference.md",
    "guarantees": "guarantees.md",
    "batching": "batching.md",
    "models": "models.md",
    "redis": "redis.md",
    "operating": "operating.md",
    "benchmarks": "benchmarks.md",
    "development": "development.md",
}


def page(name: str) -> Path:
    assert name in PAGES, f"no documentation page for {name!r}; known: {sorted(PAGES)}"
    return DOCS / PAGES[name]


def section(name: str) -> str:
    """The text of the page that documents ``name``."""
    return page(name).read_text()
