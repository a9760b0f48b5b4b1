"""docs/helm-values.md is what tests/helm/values_table.py generates from values.yaml and values.schema.json,
and every value of the chart is declared in the schema and documented."""

from __future__ import annotations

import json

import values_table
import yaml


def test_committed_tables_are_the_generated_one() -> None:
    assert values_table.OUT.read_text() == values_table.render(), (
        "docs/helm-values.md is stale: run python tests/helm/values_table.py --write")
    readme = values_table.README.read_text()
    assert values_table.readme(readme) == readme, (
        "the chart README's values table is stale: run python tests/helm/values_table.py --write")
    assert values_table.table() in readme
    assert values_table.main(["--check"]) == 0


def test_every_value_is_in_the_schema_with_a_type_and_a_meaning() -> None:
    text = (values_table.CHART / "values.yaml").read_text()
    schema = json.loads((values_table.CHART / "values.schema.json").read_text())
    docs, flow = values_table.comments(text)
    rows = values_table.leaves(yaml.safe_load(text), schema, flow)
    assert len(rows) > 100
    for path, default, node in rows:
        assert "type" in node or "enum" in node or "anyOf" in node, f"{path}: the schema gives no type"
        if default is values_table.SECTION:
            continue  # a map taken apart: its keys carry the meaning
        assert docs.get(path) or node.get("description"), f"{path}: no comment in values.yaml, no description"


def test_a_value_missing_from_the_schema_is_named(tmp_path, monkeypatch) -> None:
    chart = tmp_path / "chart"
    chart.mkdir()
    (chart / "values.yaml").write_text("image:\n  repository: x\n  # new\n  registry: r\n")
    (chart / "values.schema.json").write_text(json.dumps(
        {"properties": {"image": {"type": "object", "properties": {"repository": {"type": "string"}}}}}))
    monkeypatch.setattr(values_table, "CHART", chart)
    assert values_table.main([]) == 2


def test_stale_docs_are_found(tmp_path, monkeypatch) -> None:
    out, readme = tmp_path / "helm-values.md", tmp_path / "README.md"
    out.write_text(values_table.render())
    readme.write_text(f"# chart\n{values_table.START}| old |\n{values_table.END}\nmore\n")
    monkeypatch.setattr(values_table, "OUT", out)
    monkeypatch.setattr(values_table, "README", readme)
    monkeypatch.setattr(values_table, "ROOT", tmp_path)
    assert values_table.main(["--check"]) == 1
    assert values_table.main(["--write"]) == 0 and values_table.main(["--check"]) == 0
    assert readme.read_text().endswith(f"{values_table.END}\nmore\n") and "| old |" not in readme.read_text()
