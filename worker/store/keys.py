"""What both stores share: the result-cache key and the clock they read."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable

from worker.core.ports import Clock

TimeSource = Clock | Callable[[], float]


def cache_key(model_name: str, model_version: str, input_bytes: bytes) -> str:
    """Content hash identifying one model's result for one input: sha256 hex of name, version and bytes.

    Name and version are length-prefixed so that ("ab", "c") and ("a", "bc") never collide.
    """
    h = hashlib.sha256()
    for part in (model_name.encode(), model_version.encode()):
        h.update(len(part).to_bytes(4, "big"))
        h.update(part)
    h.update(input_bytes)
    return h.hexdigest()


def as_time_fn(clock: TimeSource | None) -> Callable[[], float]:
    """Accept a ``Clock`` (``.now()``), a plain callable, or None (``time.monotonic``)."""
    if clock is None:
        return time.monotonic
    now = getattr(clock, "now", None)
    if callable(now):
        return now
    if callable(clock):
        return clock
    raise TypeError(f"clock must have now() or be callable, got {type(clock).__name__}")
