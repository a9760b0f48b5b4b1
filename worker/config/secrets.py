"""``${env:NAME}`` and ``${file:/path}`` references in string values, resolved."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_SECRET_REF = re.compile(r"\$\{(env|file):([^}]+)\}")


def resolve_secrets(value: Any, path: str, environ: dict[str, str], missing: dict[str, str]) -> Any:
    """``value`` with its ``${env:...}`` / ``${file:...}`` references replaced. One that cannot be resolved is
    left as written, and ``missing`` gets its path and the reason."""
    if isinstance(value, dict):
        return {k: resolve_secrets(v, f"{path}.{k}", environ, missing) for k, v in value.items()}
    if isinstance(value, list):
        return [resolve_secrets(v, f"{path}[{i}]", environ, missing) for i, v in enumerate(value)]
    if isinstance(value, str) and "${" in value:
        def sub(m: re.Match[str]) -> str:
            kind, ref = m.group(1), m.group(2).strip()
            if kind == "env":
                if ref not in environ:
                    missing.setdefault(path, f"{path}: environment variable {ref!r} is not set")
                    return m.group(0)
                return environ[ref]
            try:
                return read_utf8(Path(ref)).strip()
            except OSError as e:
                missing.setdefault(path, f"{path}: cannot read secret file {ref!r}: {e.strerror}")
            except UnicodeDecodeError as e:
                missing.setdefault(path, f"{path}: cannot read secret file {ref!r}: {not_utf8(e)}")
            return m.group(0)
        return _SECRET_REF.sub(sub, value)
    return value


def read_utf8(p: Path) -> str:
    # Not the locale's encoding (read_text's default): the same file must read the same on every machine.
    return p.read_bytes().decode("utf-8-sig")  # -sig: a BOM (Notepad) is no part of a secret


def not_utf8(e: UnicodeDecodeError) -> str:
    """Where the first byte that is not UTF-8 is (not the byte: a secret file's content stays out of
    errors)."""
    line = e.object[:e.start].count(b"\n") + 1
    return f"not UTF-8 (line {line}, byte offset {e.start}); save it as UTF-8"
