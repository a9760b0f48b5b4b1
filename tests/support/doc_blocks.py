"""The fenced code blocks of a docs page, for tests that run what the page shows."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
_FENCE = re.compile(r'^```(\w+)(?: title="([^"]+)")?\n(.*?)^```$', re.M | re.S)


def blocks(page: str | Path) -> list[tuple[str, str | None, str]]:
    """``(language, title or None, text)`` of each fenced block of ``page`` (relative to the repo root)."""
    text = (ROOT / page).read_text()
    return [(m.group(1), m.group(2), m.group(3)) for m in _FENCE.finditer(text)]


def titled(page: str | Path) -> dict[str, str]:
    """The blocks with a ``title="file.ext"``, by title: the files a page asks the reader to write."""
    out: dict[str, str] = {}
    for _, title, text in blocks(page):
        if title is not None:
            assert title not in out, f"{page}: two blocks titled {title!r}"
            out[title] = text
    return out


def commands(page: str | Path, program: str) -> list[str]:
    """The lines of the page's bash blocks that run ``program`` (continuation lines joined)."""
    found = []
    for lang, _, text in blocks(page):
        if lang != "bash":
            continue
        for line in text.replace("\\\n", " ").splitlines():
            if line.split(" ", 1)[0] == program:
                found.append(line)
    return found
