"""Generates the chart's values table from values.yaml and values.schema.json: docs/helm-values.md, and the
same table in the chart's README.md (between its values-table markers, for `helm show readme`).

Each row is one value: its key, its type (from the schema), its default (from values.yaml) and its meaning
(the comment above the key in values.yaml, or after it on the same line). `config` is one row: it is the
worker's own config, documented on the configuration reference page.

    python tests/helm/values_table.py            # print the table
    python tests/helm/values_table.py --write    # rewrite docs/helm-values.md and the README's table
    python tests/helm/values_table.py --check    # exit 1 when either differs from the values

Exit 0 on success, 1 when --check finds the file stale, 2 when a value has no schema entry.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kafka-inference-worker"
OUT = ROOT / "docs" / "helm-values.md"
README = CHART / "README.md"
START, END = "<!-- values-table:start -->\n", "<!-- values-table:end -->"
# Values rendered as one row: their content is not the chart's (the worker config, free-form maps).
WHOLE = {"config"}
SECTION = object()  # leaves(): the row of a map taken apart into its keys
_KEY = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.\-]+):(?P<rest>.*)$")

HEADER = """# Helm chart values

Every value of the `kafka-inference-worker` chart (`helm/kafka-inference-worker/values.yaml`), generated
from the values file's comments and `values.schema.json` by `tests/helm/values_table.py`; a test checks
that this page matches them. `config` holds the worker's own configuration: see the configuration
reference. Set values with `-f my-values.yaml` or `--set key=value`; the schema refuses unknown keys and
wrong types when the chart is rendered.

"""
TABLE_HEAD = "| Key | Type | Default | Meaning |\n| --- | --- | --- | --- |\n"


def comments(text: str) -> tuple[dict[str, str], set[str]]:
    """Dotted key path -> the comment that documents it (lines above it, then one after it); and the paths
    written in flow style (``key: {a: 1, b: 2}``), which stay one row."""
    out: dict[str, str] = {}
    flow: set[str] = set()
    stack: list[tuple[int, str]] = []
    pending: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            pending = []
            continue
        if stripped.startswith("#"):
            body = stripped.lstrip("#").strip()
            if not re.fullmatch(r"-+", body):
                pending.append(body)
            continue
        m = _KEY.match(line)
        if m is None or stripped.startswith("-"):
            pending = []
            continue
        indent = len(m.group("indent"))
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([k for _, k in stack] + [m.group("key")])
        stack.append((indent, m.group("key")))
        if m.group("rest").strip().startswith("{"):
            flow.add(path)
        inline = m.group("rest").partition(" #")[2].strip() if " #" in m.group("rest") else ""
        text_ = " ".join(pending + ([inline] if inline else []))
        if text_:
            out[path] = text_
        pending = []
    return out, flow


def leaves(values: Any, schema: dict[str, Any], flow: set[str],
           prefix: str = "") -> list[tuple[str, Any, dict[str, Any]]]:
    """(dotted path, default, schema node) of every value, a map the schema declares by its properties taken
    apart into its keys (after a SECTION row of its own) unless it is written in flow style."""
    out: list[tuple[str, Any, dict[str, Any]]] = []
    for key, value in values.items():
        path = f"{prefix}{key}"
        node = (schema.get("properties") or {}).get(key)
        if node is None:
            raise LookupError(f"{path}: in values.yaml but not in values.schema.json")
        if isinstance(value, dict) and value and "properties" in node and path not in WHOLE | flow:
            out.append((path, SECTION, node))
            out += leaves(value, node, flow, f"{path}.")
        else:
            out.append((path, value, node))
    return out


def type_of(node: dict[str, Any]) -> str:
    if "enum" in node:
        return " \\| ".join(f"`{json.dumps(v)}`" for v in node["enum"])
    if "anyOf" in node:
        return " or ".join(type_of(n) for n in node["anyOf"])
    t = node.get("type", "any")
    return " or ".join(t) if isinstance(t, list) else t


def _cell(text: str) -> str:
    """Text for a table cell: pipes escaped, and outside code spans <...> escaped (Markdown reads it as
    HTML)."""
    parts = text.replace("|", "\\|").replace("\n", " ").split("`")
    for i in range(0, len(parts), 2):
        parts[i] = parts[i].replace("<", "&lt;").replace(">", "&gt;")
    return "`".join(parts)


def table() -> str:
    text = (CHART / "values.yaml").read_text()
    values = yaml.safe_load(text)
    schema = json.loads((CHART / "values.schema.json").read_text())
    docs, flow = comments(text)
    rows = []
    for path, default, node in leaves(values, schema, flow):
        meaning = docs.get(path) or node.get("description", "")
        if default is SECTION:
            if meaning:  # a section's comment is about the keys below it
                rows.append(f"| `{path}` | object | | {_cell(meaning)} |")
            continue
        shown = "see values.yaml" if path in WHOLE else f"`{json.dumps(default)}`"
        rows.append(f"| `{path}` | {type_of(node)} | {_cell(shown)} | {_cell(meaning)} |")
    return TABLE_HEAD + "\n".join(rows) + "\n"


def render() -> str:
    """docs/helm-values.md."""
    return HEADER + table()


def readme(text: str) -> str:
    """The chart README ``text`` with the table between its markers replaced."""
    head, sep, rest = text.partition(START)
    if not sep or END not in rest:
        raise LookupError(f"{README.relative_to(ROOT)}: no {START.strip()} ... {END} markers")
    return head + START + table() + END + rest.partition(END)[2]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help=f"write {OUT.relative_to(ROOT)}")
    mode.add_argument("--check", action="store_true", help=f"exit 1 when {OUT.relative_to(ROOT)} is stale")
    args = ap.parse_args(argv)
    try:
        page = render()
        chart_readme = readme(README.read_text())
    except LookupError as e:
        print(f"values_table: {e}", file=sys.stderr)
        return 2
    if args.write:
        OUT.write_text(page)
        README.write_text(chart_readme)
    elif args.check:
        stale = [p.relative_to(ROOT) for p, want in ((OUT, page), (README, chart_readme))
                 if not p.exists() or p.read_text() != want]
        if stale:
            print(f"{', '.join(map(str, stale))}: stale; run python tests/helm/values_table.py --write",
                  file=sys.stderr)
            return 1
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    sys.exit(main())
