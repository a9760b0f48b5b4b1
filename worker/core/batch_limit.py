"""One lane's batch limit after out-of-memory errors: a pure state machine, one object per lane.

A lane starts without a limit: the configured max batch size applies. An out-of-memory error on a batch
of ``n`` lowers the limit to the largest size known to fit (``good``), else to half the failed batch, never
below 1 and never to ``n`` itself. After ``patience`` successful batches in a row (``grow_after`` at
first) the limit steps up (x ``grow_factor``, at least +1) until it reaches the lane's ``ceiling``, where
it is lifted. A step up that runs out of memory again doubles ``patience``, up to ``grow_after *
MAX_BACKOFF``: a lane that fits only just under its max does not run out of memory every ``grow_after``
batches. The lift is a step like the others (it is probed too).

The ceiling is the lane's configured max batch size, or, for a lane without one, the largest batch seen;
a model that takes at most ``cap`` records at once lowers a configured one for good (``cap``). The limit
is never above the ceiling and never below 1.

``snapshot`` / ``restore`` take the state back to an earlier point: when every chunk that ran out of memory
during one recovery held a record that does so even alone, the batch size was not the cause.

Every transition returns a ``LimitChange`` when the max batch size in force changed (the caller logs it and
tells the scheduler), else None. Pure: no clocks, threads or I/O; the caller serializes calls.
"""

from __future__ import annotations

from dataclasses import dataclass

MAX_BACKOFF = 64  # patience never exceeds grow_after * MAX_BACKOFF


@dataclass(frozen=True, slots=True, kw_only=True)
class LimitPolicy:
    """How a lowered limit climbs back: after ``grow_after`` successes in a row, x ``grow_factor``."""

    grow_after: int = 100
    grow_factor: float = 1.25

    def __post_init__(self) -> None:
        if self.grow_after < 1:
            raise ValueError(f"grow_after must be >= 1, got {self.grow_after}")
        if not self.grow_factor >= 1.0:
            raise ValueError(f"grow_factor must be >= 1, got {self.grow_factor}")


@dataclass(frozen=True, slots=True, kw_only=True)
class LimitChange:
    """The max batch size in force changed from ``before`` to ``after`` (None: unknown, no ceiling yet);
    ``lifted``: the lane has no limit any more, its ceiling applies."""

    before: int | None
    after: int | None
    lifted: bool


@dataclass(frozen=True, slots=True)
class LimitState:
    """What ``restore`` puts back (``good`` only grows: a size that ran stays known to fit)."""

    limit: int | None
    patience: int
    probing: bool
    good: int
    streak: int


class BatchLimit:
    """One lane's limit. ``limit`` None = no limit (the ceiling applies); see the module docstring."""

    __slots__ = ("policy", "configured", "ceiling", "limit", "patience", "probing", "good", "streak")

    def __init__(self, policy: LimitPolicy, configured: int | None = None) -> None:
        if configured is not None and configured < 1:
            raise ValueError(f"configured max batch size must be >= 1, got {configured}")
        self.policy = policy
        self.configured = configured  # None: the ceiling follows the largest batch seen
        self.ceiling: int | None = configured
        self.limit: int | None = None
        self.patience = policy.grow_after  # successes in a row before the next step up
        self.probing = False  # the current limit (or the lift) is a step up not yet proven
        self.good = 0  # largest batch that ran without running out of memory (since the last reset)
        self.streak = 0  # successes in a row at the current limit

    def __repr__(self) -> str:
        return (f"BatchLimit(limit={self.limit}, ceiling={self.ceiling}, patience={self.patience}, "
                f"probing={self.probing}, good={self.good}, streak={self.streak})")

    def seen(self, n: int) -> None:
        """A batch of ``n`` reached the device: the ceiling of a lane without a configured max follows it."""
        if self.configured is None and (self.ceiling is None or n > self.ceiling):
            self.ceiling = n

    def cap(self, cap: int) -> LimitChange | None:
        """The model takes at most ``cap`` records at once: a configured lane's ceiling is at most that, for
        good. A lane without a configured max keeps following the batches it is given."""
        if cap < 1:
            raise ValueError(f"cap must be >= 1, got {cap}")
        if self.configured is None:
            return None
        self.ceiling = min(self.configured, cap)
        return self.lower(cap) if self.configured > cap else None

    def succeeded(self, n: int) -> LimitChange | None:
        """A batch of ``n`` ran; the ``patience``-th success in a row under a limit steps it up."""
        self.seen(n)
        if n > self.good:
            self.good = n
        limit = self.limit
        if limit is None:
            return None
        self.streak += 1
        if self.streak < self.patience:
            return None
        return self._grow(max(limit + 1, int(limit * self.policy.grow_factor)))

    def out_of_memory(self, n: int) -> LimitChange | None:
        """A batch of ``n`` records ran out of memory: back to the largest size known to fit, else half."""
        self.seen(n)
        if self.good >= n:  # it fitted before; memory got tighter (longer inputs, fragmentation)
            self.good = 0
        if self.probing:  # a step up failed: wait twice as long before the next
            self.probing = False
            self.patience = min(self.patience * 2, self.policy.grow_after * MAX_BACKOFF)
        return self.lower(max(1, n // 2, self.good))

    def lower(self, new: int) -> LimitChange | None:
        """Limit the lane to ``new`` (at most the ceiling) unless it is limited to that or less already
        (a concurrent recovery lowered it further)."""
        if new < 1:
            raise ValueError(f"max batch size must be >= 1, got {new}")
        self.streak = 0
        old = self.limit
        if self.ceiling is None:
            self.ceiling = new
        new = min(new, self.ceiling)
        if old is not None and new >= old:
            return None
        self.limit = new
        self.probing = False
        return LimitChange(before=old if old is not None else self.ceiling, after=new, lifted=False)

    def _grow(self, new: int) -> LimitChange:
        old = self.limit
        ceiling = self.ceiling if self.ceiling is not None else new
        self.streak = 0
        # The lift is a step up like the others: an out-of-memory error at the full size doubles the wait.
        self.probing = True
        if new >= ceiling:
            self.limit = None
            return LimitChange(before=old, after=ceiling, lifted=True)
        self.limit = new
        return LimitChange(before=old, after=new, lifted=False)

    def snapshot(self) -> LimitState:
        return LimitState(self.limit, self.patience, self.probing, self.good, self.streak)

    def restore(self, state: LimitState) -> LimitChange | None:
        """Back to ``state`` (``good`` keeps the larger of the two; the limit stays within the ceiling)."""
        old = self.limit
        limit = state.limit
        if limit is not None and self.ceiling is not None:
            limit = min(limit, self.ceiling)
        self.limit, self.patience, self.probing = limit, state.patience, state.probing
        self.streak = state.streak
        self.good = max(state.good, self.good)
        if old == limit:
            return None
        after = limit if limit is not None else self.ceiling
        return LimitChange(before=old, after=after, lifted=limit is None)
