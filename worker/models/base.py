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
    """One JSON-able value per row of a (CPU) batch output: tensor/ndarray rows, or a dict/tuple of them.
    Every part must have exactly ``n`` rows: a part with another count (a per-batch value next to per-row
    ones) would otherwise be cut or padded into the wrong records' results."""
    return _split_rows(output, n)  # (a wrong count at the top is the engine's OutputCountError)


def _split_rows(output: Any, n: int, where: str = "output") -> list[Any]:
    if isinstance(output, Mapping):
        cols = {k: _rows_of(v, n, f"{where}[{k!r}]") for k, v in output.items()}
        return [{k: c[i] for k, c in cols.items()} for i in range(n)]
    if (
        isinstance(output, tuple | list)
        and output
        and all(hasattr(v, "tolist") or isinstance(v, Mapping) for v in output)
    ):
        parts = [_rows_of(v, n, f"{where}[{i}]") for i, v in enumerate(output)]
        return [[p[i] for p in parts] for i in range(n)]
    tolist = getattr(output, "tolist", None)
    if tolist is not None:
        rows = tolist()
        return rows if isinstance(rows, list) else [rows]
    return list(output)


def _rows_of(part: Any, n: int, where: str) -> list[Any]:
    rows = _split_rows(part, n, where)
    if len(rows) != n:
        raise ValueError(f"split_rows: {where} has {len(rows)} rows for a batch of {n}; every part of a batch "
                         "output needs one row per record (write split() for per-batch values)")
    return rows
