"""``WORKER__SECTION__KEY`` environment overrides: applied to the config mapping, and named in errors about
the keys they set. ``root`` is the config's Struct type: the declared types decide how a value is read."""

from __future__ import annotations

import os
from typing import Any

import msgspec
import yaml

from worker.config.errors import ConfigError

PASSTHROUGH = {("kafka", "consumer"), ("kafka", "producer")}


def _field_type(root: Any, parts: list[str]) -> Any:
    """The type the config declares at a key path (``["kafka", "group_id"]``), None where it declares none."""
    t: Any = msgspec.inspect.type_info(root)
    for part in parts:
        t = _child_type(t, part)
    return t


def _child_type(t: Any, part: str) -> Any:
    """The type declared one key below ``t`` (a field, a list item, a dict value); None where none is."""
    if isinstance(t, msgspec.inspect.StructType):
        t = next((f.type for f in t.fields if f.name == part), None)
    elif isinstance(t, msgspec.inspect.ListType):
        t = t.item_type
    elif isinstance(t, msgspec.inspect.DictType):
        t = t.value_type
    else:
        return None
    while isinstance(t, msgspec.inspect.Metadata):
        t = t.type
    return t


def _wants_text(root: Any, parts: list[str]) -> bool:
    """The key takes a string, and no number or boolean: ``str`` or ``str | None``."""
    t = _field_type(root, parts)
    if isinstance(t, msgspec.inspect.UnionType):
        kinds = {type(x) for x in t.types} - {msgspec.inspect.NoneType}
        return kinds == {msgspec.inspect.StrType}
    return isinstance(t, msgspec.inspect.StrType)


def _env_value(root: Any, name: str, raw: str, parts: list[str], path: str) -> Any:
    """An override's value: YAML (``5``, ``true``, ``[a, b]``), except where the key takes text, so that
    ``WORKER__KAFKA__GROUP_ID=123`` or ``WORKER__MODEL__VERSION=2024-06-01`` mean the text as written, and for
    a librdkafka property, which librdkafka parses itself from text: read as YAML, the password 0123 became
    83, 12:30 became 750 (a base-60 number), on became true and 1.50 became 1.5."""
    if raw == "":
        return ""
    if _wants_text(root, parts) or (len(parts) > 2 and tuple(parts[:2]) in PASSTHROUGH):
        return raw
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{path} (from {name}): not a valid YAML value ({problem}); "
                          "to pass it as text, put it in quotes") from None


def apply_env(root: Any, data: dict[str, Any], environ: dict[str, str]) -> dict[str, str]:
    """Applies the ``WORKER__*`` overrides; returns the path each one set, with the variable's name, so an
    error about that key can say where its value came from."""
    set_by: dict[str, str] = {}
    for name, raw in sorted(environ.items()):
        if not name.startswith("WORKER__"):
            continue
        parts = [p.lower() for p in name[len("WORKER__"):].split("__") if p]
        if not parts:
            continue
        node: Any = data
        path = "$"
        for i, part in enumerate(parts[:-1]):
            if tuple(parts[:i]) in PASSTHROUGH:
                part = parts[i] = part.replace("_", ".")
            if isinstance(node, list):
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(f"{name}: no list item {part!r} at {path}")
                node = node[int(part)]
                path += f"[{int(part)}]"
                continue
            node = node.setdefault(part, {})
            path += f".{part}"
            if not isinstance(node, dict | list):
                raise ConfigError(f"{name}: {path} is not a section")
        leaf = parts[-1]
        if tuple(parts[:-1]) in PASSTHROUGH:
            leaf = parts[-1] = leaf.replace("_", ".")
        if isinstance(node, list):
            if not leaf.isdigit() or int(leaf) >= len(node):
                raise ConfigError(f"{name}: no list item {leaf!r} at {path}")
            path += f"[{int(leaf)}]"
            node[int(leaf)] = _env_value(root, name, raw, parts, path)
        else:
            path += f".{leaf}"
            node[leaf] = _env_value(root, name, raw, parts, path)
        set_by[path] = name
    return set_by


def name_overrides(root: Any, msg: str, environ: dict[str, str] | None = None) -> str:
    """``msg``, an error about a key found after loading (the model and device checks: ``$.model.devices[1]:
    ...``), with the ``WORKER__*`` variables that set the key or a section above it, as from_dict names
    them."""
    if "\n" in msg:
        return "\n".join(name_overrides(root, line, environ) for line in msg.split("\n"))
    if "(set by " in msg:
        return msg  # from_dict's own
    env = dict(os.environ) if environ is None else environ
    set_by = {}
    for name in env:
        parts = (
            [p.lower() for p in name[len("WORKER__") :].split("__") if p]
            if name.startswith("WORKER__")
            else []
        )
        if parts:
            set_by[_env_path(root, parts)] = name
    return blame(msg, set_by, below=False)


def _env_path(root: Any, parts: list[str]) -> str:
    """The key path a variable's parts address (``["model", "devices", "1"]`` -> ``$.model.devices[1]``), from
    the declared types alone, as apply_env builds it."""
    t: Any = msgspec.inspect.type_info(root)
    path = "$"
    for i, part in enumerate(parts):
        if isinstance(t, msgspec.inspect.ListType) and part.isdigit():
            path += f"[{int(part)}]"
        else:
            path += "." + (part.replace("_", ".") if tuple(parts[:i]) in PASSTHROUGH else part)
        t = _child_type(t, part)
    return path


def blame(msg: str, set_by: dict[str, str], below: bool) -> str:
    """``msg`` with the ``WORKER__*`` variables behind the key it names: one that set the key or a section
    above it, and with ``below`` one that set a key under it (``WORKER__KAFKAX__FOO`` -> ``$.kafkax``)."""
    path = msg.split(": ", 1)[0]
    if not path.startswith("$"):
        return msg

    def under(inner: str, outer: str) -> bool:
        return inner.startswith((outer + ".", outer + "["))

    names = sorted(name for p, name in set_by.items()
                   if p == path or under(path, p) or (below and under(p, path)))
    return f"{msg} (set by {', '.join(names)})" if names else msg
