"""``worker run`` with ``model.processes: N`` (or ``--processes N``): N worker processes sharing the
device(s).

Each child is a full ``worker run``: its own consumer (a member of the one consumer group), offsets,
producers, store client and metrics/health server. What differs between them comes in through the
environment, as ``WORKER__*`` overrides of the same config file:

- ``model.processes`` is 1 (a child never supervises);
- the metrics/health port is ``metrics.port + index`` (0 stays 0: any free port each);
- exactly-once: the transactional id is ``<id>-<index>``, where ``<id>`` is ``delivery.transactional_id`` or
  its default ``<group_id>-<hostname>``: stable per index, so a restarted child fences its dead predecessor.

The supervisor restarts a child that exits by itself, after a backoff that doubles from ``BACKOFF_S`` up to
``MAX_BACKOFF_S`` (back to the start once a child has run ``STABLE_S``). A child that exits ``MAX_EXITS``
times within ``EXIT_WINDOW_S`` is crash-looping: the supervisor drains the others and exits 1 saying which
child and how it exited. A child that exits 2 (its config is bad) stops everything with exit 2.

SIGTERM/SIGINT: the supervisor sends SIGTERM to every child, waits for them for
``delivery.shutdown_timeout_s`` plus ``DRAIN_MARGIN_S`` (a child's own stop takes up to about 13 s past its
shutdown timeout), then kills the ones left. Exit 0 when every child exited 0. On Linux each child gets
SIGTERM when the supervisor dies (even by kill -9), so no child outlives it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from worker.config.settings import Config, ConfigError

log = logging.getLogger("worker.supervisor")

BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_S = 60.0
MAX_EXITS = 5
EXIT_WINDOW_S = 120.0
DRAIN_MARGIN_S = 13.0
POLL_S = 0.1
# Set in each child's environment: its index (0..N-1), for its logs and for anyone reading /proc.
INDEX_ENV = "KIW_PROCESS_INDEX"


class Child(Protocol):
    """What the supervisor needs of a started process (subprocess.Popen has all of it)."""

    pid: int

    def poll(self) -> int | None: ...

    def send_signal(self, sig: int) -> None: ...

    def kill(self) -> None: ...


# index -> a started child process.
ChildFactory = Callable[[int], Child]


@dataclass(frozen=True, kw_only=True)
class RestartPolicy:
    backoff_s: float = BACKOFF_S
    max_backoff_s: float = MAX_BACKOFF_S
    stable_s: float = STABLE_S
    max_exits: int = MAX_EXITS
    exit_window_s: float = EXIT_WINDOW_S

    def delay(self, streak: int) -> float:
        """The wait before the restart that follows ``streak`` exits in a row without a stable run."""
        return float(min(self.backoff_s * 2 ** max(streak - 1, 0), self.max_backoff_s))


@dataclass
class Slot:
    """One child index: the process running it (None while it waits for its restart) and its exit history."""

    index: int
    child: Child | None = None
    started_at: float = 0.0
    restart_at: float | None = None
    streak: int = 0  # exits in a row, each after a run shorter than stable_s
    exits: deque[float] = field(default_factory=deque)  # times of the exits within the policy's window
    last_rc: int | None = None


class Supervisor:
    """The restart/drain state machine, driven by ``step(now)``; ``run()`` drives it with the real clock.

    ``exit_code`` is None while it runs and the process's exit code once every child is gone."""

    def __init__(self, factory: ChildFactory, processes: int, *, drain_s: float,
                 policy: RestartPolicy | None = None) -> None:
        self.factory = factory
        self.policy = policy or RestartPolicy()
        self.drain_s = drain_s
        self.slots = [Slot(i) for i in range(processes)]
        self.stop_at: float | None = None  # when the drain began
        self.failure: str | None = None  # why the supervisor gives up (exit 1 or 2)
        self.failure_rc = 1
        self.killed = 0  # children killed at the end of the drain
        self.exit_code: int | None = None
        self.restarts = 0

    def start(self, now: float) -> None:
        for slot in self.slots:
            self._launch(slot, now)

    def request_stop(self, now: float) -> None:
        """Drain: SIGTERM to every live child (once); a child waiting for its restart is not restarted."""
        if self.stop_at is not None:
            return
        self.stop_at = now
        for slot in self.slots:
            slot.restart_at = None
            if slot.child is not None:
                with contextlib.suppress(ProcessLookupError):
                    slot.child.send_signal(signal.SIGTERM)

    def step(self, now: float) -> None:
        for slot in self.slots:
            if slot.child is not None:
                rc = slot.child.poll()
                if rc is not None:
                    self._exited(slot, rc, now)
            elif slot.restart_at is not None and now >= slot.restart_at and self.stop_at is None:
                self._launch(slot, now)
        live = [(s, s.child) for s in self.slots if s.child is not None]
        if self.stop_at is not None and live and now - self.stop_at >= self.drain_s:
            for slot, child in live:
                log.error("child %d (pid %d) still running %.0f s after the stop: killing it",
                          slot.index, child.pid, self.drain_s)
                with contextlib.suppress(ProcessLookupError):
                    child.kill()
                self.killed += 1
        if self.stop_at is not None and not live:
            self.exit_code = self._final_code()

    def _final_code(self) -> int:
        if self.failure is not None:
            return self.failure_rc
        if self.killed or any(s.last_rc not in (0, None) for s in self.slots):
            return 1
        return 0

    def _launch(self, slot: Slot, now: float) -> None:
        slot.child = self.factory(slot.index)
        slot.started_at = now
        slot.restart_at = None
        slot.last_rc = None
        log.info("child %d started (pid %d)", slot.index, slot.child.pid)

    def _exited(self, slot: Slot, rc: int, now: float) -> None:
        pid = slot.child.pid if slot.child is not None else -1
        slot.child = None
        slot.last_rc = rc
        if self.stop_at is not None:
            (log.info if rc == 0 else log.warning)("child %d (pid %d) exited with %d", slot.index, pid, rc)
            return
        if rc == 2:
            self._give_up(f"child {slot.index} (pid {pid}) exited 2: the configuration is refused (its "
                          "'config error' lines above name the key)", now, rc=2)
            return
        ran = now - slot.started_at
        slot.streak = 1 if ran >= self.policy.stable_s else slot.streak + 1
        slot.exits.append(now)
        while slot.exits and now - slot.exits[0] > self.policy.exit_window_s:
            slot.exits.popleft()
        if len(slot.exits) >= self.policy.max_exits:
            self._give_up(f"child {slot.index} exited {len(slot.exits)} times within "
                          f"{self.policy.exit_window_s:.0f} s (last: {describe_exit(rc)} after {ran:.1f} s): "
                          "it is crash-looping; see its log lines above", now, rc=1)
            return
        delay = self.policy.delay(slot.streak)
        slot.restart_at = now + delay
        self.restarts += 1
        log.warning("child %d (pid %d) %s after %.1f s; restarting it in %.1f s", slot.index, pid,
                    describe_exit(rc), ran, delay)

    def _give_up(self, why: str, now: float, *, rc: int) -> None:
        self.failure, self.failure_rc = why, rc
        log.error("giving up: %s; stopping the other children", why)
        self.request_stop(now)

    def run(self, stop: threading.Event, clock: Callable[[], float] = time.monotonic) -> int:
        """Until every child is gone after a stop (``stop`` set, or a failure). Returns the exit code."""
        if stop.is_set():  # stopped before any child started: nothing to drain
            return 0
        self.start(clock())
        while self.exit_code is None:
            if stop.is_set():
                self.request_stop(clock())
            self.step(clock())
            if self.exit_code is None:
                time.sleep(POLL_S)
        if self.failure is not None:
            print(f"error: {self.failure}", file=sys.stderr)
        return self.exit_code


def describe_exit(rc: int) -> str:
    if rc < 0:
        try:
            return f"was killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"was killed by signal {-rc}"
    return f"exited with {rc}"


def child_env(cfg: Config, index: int, base: Mapping[str, str], metrics_port: int | None) -> dict[str, str]:
    """The environment of child ``index``: ``base`` plus the overrides that make it one member of N."""
    env = dict(base)
    env[INDEX_ENV] = str(index)
    env["WORKER__MODEL__PROCESSES"] = "1"
    port = cfg.metrics.port if metrics_port is None else metrics_port
    env["WORKER__METRICS__PORT"] = str(port + index if port else 0)
    # --metrics-port turns the endpoint on (cli.cmd_run); the children read the file, not the flag.
    env["WORKER__METRICS__ENABLED"] = "true" if cfg.metrics.enabled else "false"
    if cfg.delivery.mode == "exactly_once":
        # The runner's own default (worker/pipeline/exactly_once.py), then the index.
        tid = cfg.delivery.transactional_id or f"{cfg.kafka.group_id}-{socket.gethostname()}"
        env["WORKER__DELIVERY__TRANSACTIONAL_ID"] = f"{tid}-{index}"
    return env


def check_ports(cfg: Config, processes: int, metrics_port: int | None) -> None:
    """Ports port..port+N-1 must exist: a ConfigError naming where the port came from otherwise."""
    port = cfg.metrics.port if metrics_port is None else metrics_port
    if cfg.metrics.enabled and port and port + processes - 1 > 65535:
        source = "--metrics-port" if metrics_port is not None else "$.metrics.port"
        raise ConfigError(f"{source}: {processes} processes serve metrics on ports "
                          f"{port}..{port + processes - 1}, past 65535; choose a lower port")


def _die_with_parent(parent: int) -> Callable[[], None]:
    """A preexec_fn: the child gets SIGTERM when the supervisor dies (Linux prctl PR_SET_PDEATHSIG), and
    drains as it would on a stop; elsewhere nothing."""

    def preexec() -> None:
        if not sys.platform.startswith("linux"):
            return
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGTERM), 0, 0, 0)  # 1: PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the supervisor died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def popen_factory(cfg: Config, config_path: str, metrics_port: int | None,
                  environ: Mapping[str, str] | None = None) -> ChildFactory:
    """Children as ``python -m worker run --config PATH``, sharing the supervisor's stdout and stderr."""
    base = dict(os.environ if environ is None else environ)
    parent = os.getpid()

    def start(index: int) -> Child:
        return subprocess.Popen([sys.executable, "-m", "worker", "run", "--config", config_path],
                                env=child_env(cfg, index, base, metrics_port),
                                preexec_fn=_die_with_parent(parent))

    return start


def supervise(cfg: Config, config_path: str, processes: int, *, metrics_port: int | None = None,
              factory: ChildFactory | None = None) -> int:
    """Runs ``processes`` children until SIGTERM/SIGINT; the exit code (module docstring)."""
    check_ports(cfg, processes, metrics_port)
    stop = threading.Event()
    requests = 0

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal requests
        requests += 1
        if requests == 1:
            log.info("%s: stopping %d children", signal.Signals(signum).name, processes)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    sup = Supervisor(factory or popen_factory(cfg, config_path, metrics_port), processes,
                     drain_s=cfg.delivery.shutdown_timeout_s + DRAIN_MARGIN_S)
    log.info("supervising %d worker processes", processes)
    rc = sup.run(stop)
    log.info("all children exited", extra={"exit_code": rc, "restarts": sup.restarts, "killed": sup.killed})
    return rc
