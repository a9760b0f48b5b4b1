"""The fuzz targets by name: each a hypothesis strategy of arguments and the check that takes them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from hypothesis import strategies as st

from tests.fuzz import target_config, target_dlq, target_intake


class Target(NamedTuple):
    strategy: Callable[[], st.SearchStrategy[tuple[Any, ...]]]
    check: Callable[..., None]


TARGETS: dict[str, Target] = {
    "intake-json": Target(lambda: target_intake.records("json"),
                          lambda *a: target_intake.check("json", *a)),
    "intake-msgpack": Target(lambda: target_intake.records("msgpack"),
                             lambda *a: target_intake.check("msgpack", *a)),
    "config": Target(lambda: st.tuples(target_config.yaml_bytes()), target_config.check),
    "dlq": Target(target_dlq.dead_letters, target_dlq.check),
}
