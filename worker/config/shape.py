"""Every key and value of a config mapping checked against its Structs at once, not the first problem only.

``msgspec.convert`` stops at the first bad field; ``shape_problems`` walks the mapping along the Struct
fields and reports each unknown key (with the closest known name: ``did you mean `max_wait_ms`?``), each
missing required key and each bad value, naming its path. Values are checked one field at a time with
``msgspec.convert``, so the types and bounds are exactly the Structs'.
"""

from __future__ import annotations

import difflib
import re
import typing
from collections.abc import Iterable
from typing import Any

import msgspec

from worker.config.errors import ConfigError

_AT = re.compile(r"^(.*?)(?: - at `\$([^`]*)`)?$", re.S)


def did_you_mean(name: str, known: Iterable[str]) -> str:
    """``; did you mean `x`?`` for the known name closest to ``name`` (difflib), or "" when none is close."""
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"; did you mean `{close[0]}`?" if close else ""


def unknown_key(path: str, key: str, known: Iterable[str]) -> str:
    return f"{path}.{key}: unknown key{did_you_mean(key, known)}"


def _struct_of(tp: Any) -> type[msgspec.Struct] | None:
    tp = _strip(tp)
    return tp if isinstance(tp, type) and issubclass(tp, msgspec.Struct) else None


def _strip(tp: Any) -> Any:
    while typing.get_origin(tp) is typing.Annotated:
        tp = typing.get_args(tp)[0]
    return tp


def _value_problem(value: Any, tp: Any, path: str) -> str | None:
    try:
        msgspec.convert(value, tp, strict=False)
    except msgspec.ValidationError as e:
        what, inner = _AT.match(str(e)).groups()  # type: ignore[union-attr]
        if what == "Expected `str` of length >= 1":
            what = "must not be empty"
        return f"{path}{inner or ''}: {what}"
    return None


def shape_problems(data: Any, struct: type[msgspec.Struct], path: str = "$") -> list[str]:
    """The problems of ``data`` as a ``struct``: one message per bad key, ``"<path>: <what>"``."""
    if not isinstance(data, dict):
        problem = _value_problem(data, struct, path)
        return [problem] if problem else []
    fields = {f.name: f for f in msgspec.structs.fields(struct)}
    problems = [unknown_key(path, k, fields) for k in data if k not in fields]
    problems += [f"{path}.{name}: required key missing" for name, f in fields.items()
                 if f.required and name not in data]
    for key, value in data.items():
        if key not in fields:
            continue
        problems += _field_problems(value, fields[key].type, f"{path}.{key}")
    return problems


def _field_problems(value: Any, tp: Any, path: str) -> list[str]:
    inner = _struct_of(tp)
    if inner is not None:
        return shape_problems(value, inner, path)
    bare = _strip(tp)
    if typing.get_origin(bare) is list and isinstance(value, list):
        (item,) = typing.get_args(bare) or (Any,)
        if _struct_of(item) is not None:
            return [p for i, v in enumerate(value) for p in _field_problems(v, item, f"{path}[{i}]")]
    problem = _value_problem(value, tp, path)
    return [problem] if problem else []


def merge(base: Any, over: Any) -> Any:
    """Mappings merge key by key; anything else (lists included) in ``over`` replaces ``base``."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = dict(base)
        for k, v in over.items():
            out[k] = merge(base[k], v) if k in base else v
        return out
    return over


def check_shape(value: Any, path: str, above: tuple[int, ...] = ()) -> None:
    """Keys are text, and no mapping or list contains itself. msgspec names a key that is not text only by its
    section ("Expected `str` - at `key` in `$.kafka`"), and a YAML alias to an anchor above it (``kafka: &k
    {consumer: *k}``) makes a structure with no end: the checks after this one would recurse until Python
    gives up (RecursionError, exit 1)."""
    if not isinstance(value, dict | list):
        return
    if id(value) in above:
        raise ConfigError(f"{path}: contains itself (a YAML alias to an anchor around it); "
                          "copy the values instead")
    if len(above) > 100:
        raise ConfigError(f"{path}: nested more than 100 levels deep")
    above = (*above, id(value))
    if isinstance(value, list):
        for i, item in enumerate(value):
            check_shape(item, f"{path}[{i}]", above)
        return
    for k, v in value.items():
        if not isinstance(k, str):
            shown = "null" if k is None else str(k)
            raise ConfigError(f"{path}: the key {shown} is not text but {type(k).__name__}; in YAML, quote "
                              f"it: '{shown}':")
        check_shape(v, f"{path}.{k}", above)


def explain(msg: str) -> str:
    # msgspec: "Object contains unknown field `x` - at `$.kafka`" -> put the path first.
    m = re.match(r"(.*) - at `(\$[^`]*)`$", msg)
    if m:
        what, path = m.groups()
        u = re.match(r"Object contains unknown field `([^`]+)`", what)
        if u:
            return f"{path}.{u.group(1)}: unknown key"
        if what == "Expected `str` of length >= 1":
            return f"{path}: must not be empty"
        return f"{path}: {what}"
    u = re.match(r"Object contains unknown field `([^`]+)`", msg)
    if u:
        return f"$.{u.group(1)}: unknown key"
    return f"$: {msg}"
