"""Starting and stopping a local server process: ports, dying with the parent, polite stop then forceful."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from typing import Any

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def terminate(proc: subprocess.Popen[Any], timeout: float, *, group: bool = False, hard: bool = False,
              wake: bool = False) -> None:
    """SIGTERM (SIGKILL when ``hard``) to the process, or its process group with ``group``; SIGKILL if it
    has not exited after ``timeout``. ``wake`` sends SIGCONT first: a stopped process cannot handle
    SIGTERM."""
    if proc.poll() is not None:
        return

    def send(sig: int) -> None:
        if group:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)

    try:
        if wake:
            send(signal.SIGCONT)
        send(signal.SIGKILL if hard else signal.SIGTERM)
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait(10)
    except ProcessLookupError:
        pass


def die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` for ``subprocess.Popen`` that makes the child get SIGKILL when its parent dies
    (``prctl(PR_SET_PDEATHSIG)``), so a server started by a test run or the demo does not outlive a
    ``kill -9``, a SIGTERM or a crash of that process. The servers run in their own session
    (``start_new_session``), so they do not get the terminal's Ctrl-C; callers still stop them themselves.

    ``None`` (no ``preexec_fn``) where it cannot work: off Linux, without a C library to call, and off the
    main thread, because Linux sends the signal when the *thread* that forked the child exits: a server
    started from a short-lived thread would be killed with that thread."""
    if not sys.platform.startswith("linux") or threading.current_thread() is not threading.main_thread():
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:  # runs in the child between fork and exec: keep it to system calls
        prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return preexec


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free on 127.0.0.1 right now (the server binds them moments later). Every socket
    stays bound until all are chosen, so two of them can never be the same port."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def free_port() -> int:
    """A port free on 127.0.0.1 right now (the server binds it moments later)."""
    return free_ports(1)[0]
