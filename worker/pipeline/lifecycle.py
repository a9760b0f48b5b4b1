"""Where the worker is in its life (``Phase``), and the time budgets of its stops (``Deadline``).

LOADING -> RUNNING (models set up) -> DRAINING (a stop: finish what is in flight, commit) -> CLOSED.
FATAL replaces RUNNING or DRAINING on an error the worker cannot go on from (exit 1); the shutdown that
follows still commits what it may. Only the loop thread changes the phase, except ``request_stop``, which
is signal-safe.
"""

from __future__ import annotations

import enum
import threading

from worker.timing.clock import Deadline, LoopClock

__all__ = ["Deadline", "Lifecycle", "Phase"]


class Phase(enum.Enum):
    LOADING = "loading"
    RUNNING = "running"
    DRAINING = "draining"
    FATAL = "fatal"
    CLOSED = "closed"


class Lifecycle:
    def __init__(self, clock: LoopClock | None = None) -> None:
        self.clock = clock
        self.phase = Phase.LOADING
        self.fatal: str | None = None  # why the worker exits 1 (the last error that ended it)
        # Set when the drain starts: nothing the stop waits for runs past it.
        self.shutdown: Deadline | None = None
        self.ready = threading.Event()  # clients made and subscribed: the loop runs
        self._stop = threading.Event()

    # ---- transitions
    def loaded(self) -> None:
        if self.phase is Phase.LOADING:
            self.phase = Phase.RUNNING

    def fail(self, reason: str) -> None:
        self.fatal = reason
        if self.phase is not Phase.CLOSED:
            self.phase = Phase.FATAL

    def drain(self, seconds: float) -> Deadline:
        self.shutdown = Deadline(seconds, self.clock)
        if self.phase is Phase.RUNNING:
            self.phase = Phase.DRAINING
        return self.shutdown

    def close(self) -> None:
        self.phase = Phase.CLOSED

    def request_stop(self) -> None:
        self._stop.set()

    # ---- questions
    @property
    def stop_requested(self) -> bool:
        return self._stop.is_set()

    @property
    def models_loaded(self) -> bool:
        return self.phase is not Phase.LOADING

    @property
    def stopping(self) -> bool:
        """The drain has started (revokes and assigns from here on are those of the stop)."""
        return self.shutdown is not None

    @property
    def closed(self) -> bool:
        return self.phase is Phase.CLOSED

    @property
    def running(self) -> bool:
        """Neither asked to stop nor failed: the loop goes on."""
        return self.fatal is None and not self._stop.is_set()
