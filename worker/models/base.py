"""Helpers shared by the handlers: option parsing with config-path errors, per-row output splitting."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, TypeVar

import msgspec

from worker.config import ConfigError

S = TypeVar("S")


def parse_options(options: Mapping[str, Any], spec: type[S], model: str) -> S:
    """Validate ``model.options`` against a strict Struct; errors name ``$.model.options.<key>``."""
    try:
        return msgspec.convert(dict(options), spec, strict=False)
    except msgspec.ValidationError as e:
        msg = str(e)
        m = re.match(r"Object contains unknown field `([^`]+)`", msg)
        if m:
            allowed = ", ".join(spec.__struct_fields__) or "none"  # type: ignore[attr-defined]
            raise ConfigError(
                f"$.model.options.{m.group(1)}: unknown option for model {model!r} (allowed: {allowed})"
            ) from None
        m = re.match(r"(.*) - at `\$(.*)`$", msg)
        if m:
            raise ConfigError(f"$.model.options{m.group(2)}: {m.group(1)}") from None
        raise ConfigError(f"$.model.options: {msg}") from None


class Options(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    """Base of the built-ins' option structs."""


def split_rows(output: Any, n: int) -> list[Any]:
    """One JSON-able value per row of a (CPU) batch output: tensor/ndarray rows, or a dict/tuple of them."""
    if isinstance(output, Mapping):
        cols = {k: split_rows(v, n) for k, v in output.items()}
        return [{k: c[i] for k, c in cols.items()} for i in range(n)]
    if (
        isinstance(output, tuple | list)
        and output
        and all(hasattr(v, "tolist") or isinstance(v, Mapping) for v in output)
    ):
        parts = [split_rows(v, n) for v in output]
        return [[p[i] for p in parts] for i in range(n)]
    tolist = getattr(output, "tolist", None)
    if tolist is not None:
        rows = tolist()
        return rows if isinstance(rows, list) else [rows]
    return list(output)
