"""The loop's clock, and ``Deadline``: a point on it that several waits share.

The loop and its rooms read time only through a ``LoopClock`` they are given (``Runner(clock=...)``, held
in ``Loop.clock``): the ``time`` module itself in production, a fake in tests.
"""

from __future__ import annotations

import time
from typing import Protocol


class LoopClock(Protocol):
    def monotonic(self) -> float:
        """Monotonic seconds."""
        ...

    def time(self) -> float:
        """Wall-clock seconds (request deadlines and result timestamps are wall-clock)."""
        ...

    def sleep(self, seconds: float, /) -> None:
        ...


class Deadline:
    """A point on the monotonic clock that several waits share: each takes what is left of it. Without a
    clock it reads this module's ``time``."""

    __slots__ = ("at", "clock")

    def __init__(self, seconds: float, clock: LoopClock | None = None) -> None:
        self.clock: LoopClock = clock if clock is not None else time
        self.at = self.clock.monotonic() + seconds

    def left(self, floor: float = 0.0) -> float:
        """Seconds left, at least ``floor`` (a flush that must at least try)."""
        return max(floor, self.at - self.clock.monotonic())

    def expired(self) -> bool:
        return self.clock.monotonic() >= self.at

    def within(self, other: Deadline | None) -> Deadline:
        """The earlier of this and ``other``."""
        return self if other is None or self.at <= other.at else other

    def cap(self, seconds: float, floor: float = 0.0) -> float:
        """``seconds``, but no more than what is left (and at least ``floor``)."""
        return min(seconds, self.left(floor))
