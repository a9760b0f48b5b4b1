"""README's sections (between ``<!-- section: NAME -->`` markers), for tests that check the docs against the code."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "README.md"


def section(name: str) -> str:
    m = re.search(rf"<!-- section: {name} -->(.*?)<!-- /section: {name} -->", README.read_text(), re.S)
    assert m, f"README has no '{name}' section"
    return m.group(1)
