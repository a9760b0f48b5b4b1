"""When to give up on a consumer that stays out of its group: ``RejoinWatch``.

Why: librdkafka rejoins a group by itself after a session timeout, but not always. After a broker restart
a consumer was seen (librdkafka 2.12, CI run of the broker-restart chaos test) with its group coordinator
request stuck in an out-queue for minutes: no assignment ever came back, the loop and its heartbeat were
fine, /healthz and /readyz said so, and the replica processed nothing. A consumer made anew joins at once,
so the runner replaces one that has been out of the group longer than a rejoin can take.

"Out of the group" starts when the consumer subscribes and when it loses its assignment (``on_lost``: a
session timeout, a fenced generation), and ends with any assignment, an empty one included (a replica with
no partition to take is still told so). A normal rebalance revokes and assigns without losing anything and
never starts the clock. A rejoin can legitimately wait for the slowest member of the group to rejoin (up to
the rebalance timeout, ``max.poll.interval.ms``), so the default allowance is that plus a session timeout.

While the broker stays away each new consumer fails to join too: the allowance doubles with every
replacement without a join between them (up to ``MAX_BACKOFF`` times the configured one), so an outage
costs a handful of consumers, not one per allowance.
"""

from __future__ import annotations

__all__ = ["MAX_BACKOFF", "RejoinWatch"]

MAX_BACKOFF = 8


class RejoinWatch:
    """``out(now)`` when the consumer is not in the group, ``joined()`` on an assignment, ``due(now)`` when it
    has been out longer than allowed, ``replaced(now)`` once a new consumer took its place. ``timeout_s`` 0:
    never due."""

    __slots__ = ("timeout_s", "since", "allowance_s", "replacements")

    def __init__(self, timeout_s: float) -> None:
        if timeout_s < 0:
            raise ValueError(f"timeout_s must be >= 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.since: float | None = None  # out of the group since (None: in it)
        self.allowance_s = timeout_s
        self.replacements = 0  # consumers replaced since the last join

    def out(self, now: float) -> None:
        """Not in the group from ``now``, unless already out since earlier."""
        if self.since is None:
            self.since = now

    def joined(self) -> None:
        self.since = None
        self.allowance_s = self.timeout_s
        self.replacements = 0

    def out_for(self, now: float) -> float:
        return 0.0 if self.since is None else max(now - self.since, 0.0)

    def due(self, now: float) -> bool:
        return self.timeout_s > 0 and self.since is not None and now - self.since >= self.allowance_s

    def replaced(self, now: float) -> None:
        """A new consumer subscribed at ``now``: its own clock starts, with twice the allowance."""
        self.since = now
        self.replacements += 1
        self.allowance_s = min(self.allowance_s * 2, self.timeout_s * MAX_BACKOFF)
