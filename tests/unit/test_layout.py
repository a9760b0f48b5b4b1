"""The package layout docs/architecture.md describes: every module of the worker lives in a package, and every
package has a place in the layers that pyproject.toml's import contracts state."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORKER = ROOT / "worker"


def _layered_packages() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    contract = re.search(r'id = "layers"\n(.*?)(?=\n\[\[|\Z)', text, re.S)
    assert contract, "pyproject.toml has no import contract with id = \"layers\""
    return set(re.findall(r"worker\.(\w+)", contract[1]))


def _packages() -> set[str]:
    return {d.name for d in WORKER.iterdir() if (d / "__init__.py").is_file()}


def test_only_the_entry_point_sits_at_the_top() -> None:
    flat = sorted(p.name for p in WORKER.glob("*.py") if p.name not in ("__init__.py", "__main__.py"))
    assert flat == [], f"modules outside a package (give each a package; docs/architecture.md): {flat}"


def test_every_package_has_a_layer() -> None:
    missing = sorted(_packages() - _layered_packages())
    assert missing == [], f"packages in no layer of pyproject.toml's 'layers' contract: {missing}"


def test_every_layer_is_a_package() -> None:
    gone = sorted(_layered_packages() - _packages() - {"__main__"})
    assert gone == [], f"layers naming no package under worker/: {gone}"


def test_the_architecture_page_names_every_package() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    unnamed = sorted(p for p in _packages() if f"`worker/{p}/`" not in page)
    assert unnamed == [], f"packages docs/architecture.md's Layout table does not name: {unnamed}"
