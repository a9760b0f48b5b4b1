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

The lane's token budget (``max_batch_tokens``: what a batch may cost in record sizes) is held the same
way, beside the count: an out-of-memory error on a batch costing ``tokens`` lowers the token limit to the
largest cost known to fit, else half of ``tokens``; it climbs back with the count, in the same steps, to
its ceiling (the configured budget, or the largest cost seen), where it is lifted and the configured
budget (maybe none) applies again. Memory grows with a batch's tokens, not its records: a lane whose
records are long is held to fewer tokens, a lane of short records keeps its count. Callers that know no
costs pass none, and only the count moves.

``snapshot`` / ``restore`` take the state back to an earlier point: when every chunk that ran out of memory
during one recovery held a record that does so even alone, the batch size was not the cause.

Every transition returns a ``LimitChange`` when the max batch size or the token budget in force changed
(the caller logs it and tells the scheduler), else None. Pure: no clocks, threads or I/O; the caller
serializes calls.
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
    ``lifted``: the lane has no limit any more, its ceiling applies. ``tokens_before`` / ``tokens_after``:
    the token budget in force (None: no budget), the same when only the count changed."""

    before: int | None
    after: int | None
    lifted: bool
    tokens_before: int | None = None
    tokens_after: int | None = None

    @property
    def tokens_changed(self) -> bool:
        return self.tokens_before != self.tokens_after


@dataclass(frozen=True, slots=True)
class LimitState:
    """What ``restore`` puts back (``good`` only grows: a size that ran stays known to fit)."""

    limit: int | None
    patience: int
    probing: bool
    good: int
    streak: int
    tokens_limit: int | None = None
    tokens_good: int = 0


class BatchLimit:
    """One lane's limit. ``limit`` None = no limit (the ceiling applies); see the module docstring."""

    __slots__ = ("policy", "configured", "ceiling", "limit", "patience", "probing", "good", "streak",
                 "configured_tokens", "tokens_ceiling", "tokens_limit", "tokens_good")

    def __init__(self, policy: LimitPolicy, configured: int | None = None,
                 configured_tokens: int | None = None) -> None:
        if configured is not None and configured < 1:
            raise ValueError(f"configured max batch size must be >= 1, got {configured}")
        if configured_tokens is not None and configured_tokens < 1:
            raise ValueError(f"configured max batch tokens must be >= 1, got {configured_tokens}")
        self.policy = policy
        self.configured = configured  # None: the ceiling follows the largest batch seen
        self.ceiling: int | None = configured
        self.limit: int | None = None
        self.patience = policy.grow_after  # successes in a row before the next step up
        self.probing = False  # the current limit (or the lift) is a step up not yet proven
        self.good = 0  # largest batch that ran without running out of memory (since the last reset)
        self.streak = 0  # successes in a row at the current limit
        self.configured_tokens = configured_tokens  # the lane's own budget (None: none)
        self.tokens_ceiling: int | None = configured_tokens  # where a token limit is lifted
        self.tokens_limit: int | None = None  # None: no token limit (the configured budget applies)
        self.tokens_good = 0  # the largest cost that ran without running out of memory

    def __repr__(self) -> str:
        return (f"BatchLimit(limit={self.limit}, ceiling={self.ceiling}, patience={self.patience}, "
                f"probing={self.probing}, good={self.good}, streak={self.streak}, "
                f"tokens_limit={self.tokens_limit}, tokens_ceiling={self.tokens_ceiling})")

    @property
    def tokens(self) -> int | None:
        """The token budget in force: the limit, else the configured budget (None: no budget)."""
        return self.tokens_limit if self.tokens_limit is not None else self.configured_tokens

    def seen(self, n: int, tokens: int | None = None) -> None:
        """A batch of ``n`` (costing ``tokens``) reached the device: the ceilings of a lane without a
        configured max or budget follow it."""
        if self.configured is None and (self.ceiling is None or n > self.ceiling):
            self.ceiling = n
        if tokens is not None and self.configured_tokens is None and (
                self.tokens_ceiling is None or tokens > self.tokens_ceiling):
            self.tokens_ceiling = tokens

    def cap(self, cap: int) -> LimitChange | None:
        """The model takes at most ``cap`` records at once: a configured lane's ceiling is at most that, for
        good. A lane without a configured max keeps following the batches it is given."""
        if cap < 1:
            raise ValueError(f"cap must be >= 1, got {cap}")
        if self.configured is None:
            return None
        self.ceiling = min(self.configured, cap)
        return self.lower(cap) if self.configured > cap else None

    def succeeded(self, n: int, tokens: int | None = None) -> LimitChange | None:
        """A batch of ``n`` (costing ``tokens``) ran; the ``patience``-th success in a row under a limit
        steps it up (the count's and the token budget's together)."""
        self.seen(n, tokens)
        if n > self.good:
            self.good = n
        if tokens is not None and tokens > self.tokens_good:
            self.tokens_good = tokens
        if self.limit is None and self.tokens_limit is None:
            return None
        self.streak += 1
        if self.streak < self.patience:
            return None
        return self._grow()

    def out_of_memory(self, n: int, tokens: int | None = None) -> LimitChange | None:
        """A batch of ``n`` records (costing ``tokens``) ran out of memory: each limit back to the largest
        size (cost) known to fit, else half."""
        self.seen(n, tokens)
        if self.good >= n:  # it fitted before; memory got tighter (longer inputs, fragmentation)
            self.good = 0
        if tokens is not None and self.tokens_good >= tokens:
            self.tokens_good = 0
        if self.probing:  # a step up failed: wait twice as long before the next
            self.probing = False
            self.patience = min(self.patience * 2, self.policy.grow_after * MAX_BACKOFF)
        t_before = self.tokens
        change = self.lower(max(1, n // 2, self.good))
        if tokens is not None:
            self._lower_tokens(max(1, tokens // 2, self.tokens_good))
        if self.tokens == t_before:
            return change
        now = self.limit if self.limit is not None else self.ceiling
        before, after, lifted = (change.before, change.after, change.lifted) if change else (now, now, False)
        return LimitChange(before=before, after=after, lifted=lifted, tokens_before=t_before,
                           tokens_after=self.tokens)

    def _lower_tokens(self, new: int) -> None:
        """Limit the lane's batches to cost ``new`` (at most the ceiling) unless limited to that or less
        already."""
        if self.tokens_ceiling is None:
            self.tokens_ceiling = new
        new = min(new, self.tokens_ceiling)
        if self.tokens_limit is None or new < self.tokens_limit:
            self.tokens_limit = new

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
        tok = self.tokens
        return LimitChange(before=old if old is not None else self.ceiling, after=new, lifted=False,
                           tokens_before=tok, tokens_after=tok)

    def _grow(self) -> LimitChange:
        factor = self.policy.grow_factor
        self.streak = 0
        # The lift is a step up like the others: an out-of-memory error at the full size doubles the wait.
        self.probing = True
        t_before = self.tokens
        t = self.tokens_limit
        if t is not None:
            new_t = max(t + 1, int(t * factor))
            self.tokens_limit = None if self.tokens_ceiling is None or new_t >= self.tokens_ceiling else new_t
        old = self.limit
        if old is None:  # only the token budget was limited
            return LimitChange(before=self.ceiling, after=self.ceiling, lifted=False, tokens_before=t_before,
                               tokens_after=self.tokens)
        new = max(old + 1, int(old * factor))
        ceiling = self.ceiling if self.ceiling is not None else new
        if new >= ceiling:
            self.limit = None
            return LimitChange(before=old, after=ceiling, lifted=True, tokens_before=t_before,
                               tokens_after=self.tokens)
        self.limit = new
        return LimitChange(before=old, after=new, lifted=False, tokens_before=t_before,
                           tokens_after=self.tokens)

    def snapshot(self) -> LimitState:
        return LimitState(self.limit, self.patience, self.probing, self.good, self.streak, self.tokens_limit,
                          self.tokens_good)

    def restore(self, state: LimitState) -> LimitChange | None:
        """Back to ``state`` (``good`` keeps the larger of the two; the limit stays within the ceiling)."""
        old, t_before = self.limit, self.tokens
        limit = state.limit
        if limit is not None and self.ceiling is not None:
            limit = min(limit, self.ceiling)
        t = state.tokens_limit
        if t is not None and self.tokens_ceiling is not None:
            t = min(t, self.tokens_ceiling)
        self.limit, self.patience, self.probing = limit, state.patience, state.probing
        self.streak = state.streak
        self.good = max(state.good, self.good)
        self.tokens_limit = t
        self.tokens_good = max(state.tokens_good, self.tokens_good)
        if old == limit and t_before == self.tokens:
            return None
        after = limit if limit is not None else self.ceiling
        return LimitChange(before=old, after=after, lifted=limit is None and old is not None,
                           tokens_before=t_before, tokens_after=self.tokens)


def chunk_end(costs: list[int], start: int, count: int, tokens: int | None) -> int:
    """Where a chunk of a batch starting at ``start`` ends: at most ``count`` items and, with ``tokens``,
    at most that cost (``costs`` per item), except that a first item over it goes alone."""
    end = min(len(costs), start + count)
    if tokens is None:
        return end
    total = 0
    for i in range(start, end):
        total += costs[i]
        if total > tokens:
            return max(i, start + 1)
    return end
