"""A config file read as YAML: UTF-8, one document, no key given twice; each failure a ConfigError naming the
file and line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from worker.config.errors import ConfigError
from worker.config.secrets import not_utf8, read_utf8


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, mapping: yaml.MappingNode, key: Any, line: int, first: int) -> None:
        super().__init__(f"line {line}: duplicate key {key!r} (first on line {first})")
        self.mapping, self.key, self.line, self.first = mapping, key, line, first

    def describe(self, root: yaml.Node | None) -> str:
        """The message, naming the key by its path from the document's root."""
        parent = _node_path(root, self.mapping, "$") if root is not None else None
        where = f"{parent}.{self.key}" if parent is not None else repr(self.key)
        return (f"line {self.line}: duplicate key {where} (first on line {self.first}); YAML would keep only "
                "the last one")


def _node_path(root: yaml.Node, target: yaml.Node, path: str) -> str | None:
    """The path (``$.batching.lanes[0]``) of ``target`` in the composed document under ``root``. Iterative and
    each node visited once: aliases make the tree a graph (``&x {self: *x}`` is a cycle)."""
    stack: list[tuple[yaml.Node, str]] = [(root, path)]
    seen: set[int] = set()
    while stack:
        node, at = stack.pop()
        if node is target:
            return at
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            stack += [(v, f"{at}.{k.value}" if isinstance(k, yaml.ScalarNode) else f"{at}.?")
                      for k, v in reversed(node.value)]
        elif isinstance(node, yaml.SequenceNode):
            stack += [(v, f"{at}[{i}]") for i, v in reversed(list(enumerate(node.value)))]
    return None


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML keeps the last of two equal keys and drops the first without a word: two ``batching:`` sections
    would lose a lane. A config file with a repeated key is an error instead."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # "<<: *anchor": explicit keys may override merged ones; the base class merges
            key = self.construct_object(key_node, deep=deep)
            line = key_node.start_mark.line + 1
            try:
                if key in first:
                    raise _DuplicateKey(node, key, line, first[key])
                first[key] = line
            except TypeError:
                continue  # an unhashable key: the base class reports it
        return super().construct_mapping(node, deep)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping at the top of the YAML file at ``path`` (an empty file is an empty mapping)."""
    p = Path(path)
    try:
        text = read_utf8(p)
    except OSError as e:
        raise ConfigError(f"cannot read config file {str(p)!r}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"cannot read config file {str(p)!r}: {not_utf8(e)}") from None
    # What yaml.load does, keeping the composed tree (to name a repeated key by its path) and the file's
    # name (positions in errors say 'in "worker.yaml", line 3' rather than 'in "<unicode string>"').
    try:
        # checks the characters first: a NUL or another control one is refused
        loader = _UniqueKeyLoader(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    loader.name = str(p)
    root: yaml.Node | None = None
    try:
        root = loader.get_single_node()
        data = loader.construct_document(root) if root is not None else None
    except _DuplicateKey as e:
        raise ConfigError(f"{p}: {e.describe(root)}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    except (ValueError, OverflowError, TypeError, AttributeError) as e:
        # PyYAML's own failures on a value it cannot build: an escape past U+10FFFF ("\U0A0010000"), a date
        # like 2024-13-45, "!!timestamp x", "!!int 0x".
        raise ConfigError(
            f"{p}: not valid YAML: a value PyYAML cannot read ({type(e).__name__}: {e})"
        ) from None
    finally:
        loader.dispose()
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"$: expected a mapping at the top of {p}, got {type(data).__name__}")
    return data
