"""Writes the JSON Schema files of the wire contract: ``python -m schemas.export [--check]``.

Model handlers' request schemas (``Request[input_type]``) are written under ``schemas/models/``.
``--check`` writes nothing and exits 1 listing stale or missing files.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from schemas import DeadLetter, Request, Result

HERE = Path(__file__).parent


def _dump(schema: Any) -> str:
    return json.dumps(schema, indent=2, sort_keys=True) + "\n"


def wanted() -> dict[Path, str]:
    files = {
        HERE / "request.schema.json": _dump(msgspec.json.schema(Request[Any])),
        HERE / "result.schema.json": _dump(msgspec.json.schema(Result)),
        HERE / "dead_letter.schema.json": _dump(msgspec.json.schema(DeadLetter)),
    }
    try:
        from worker.models.registry import builtin_input_types
    except ImportError:  # the models package is optional for the wire contract itself
        return files
    for name, input_type in builtin_input_types().items():
        schema = msgspec.json.schema(Request[input_type])  # type: ignore[valid-type]
        files[HERE / "models" / f"{name}.request.schema.json"] = _dump(schema)
    return files


def main(argv: list[str] | None = None) -> int:
    check = "--check" in (argv if argv is not None else sys.argv[1:])
    stale = []
    for path, text in wanted().items():
        if not path.exists() or path.read_text() != text:
            stale.append(path)
            if not check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    if check and stale:
        print("stale JSON Schema files (run `python -m schemas.export`):", *map(str, stale), sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
