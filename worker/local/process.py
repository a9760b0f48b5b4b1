"""Stopping a local server process: polite first, forceful if it hangs."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
from typing import Any


def terminate(proc: subprocess.Popen[Any], timeout: float, *, group: bool = False, hard: bool = False,
              wake: bool = False) -> None:
    """SIGTERM (SIGKILL when ``hard``) to the process, or its process group with ``group``; SIGKILL if it
    has not exited after ``timeout``. ``wake`` sends SIGCONT first: a stopped process cannot handle SIGTERM."""
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


def free_port() -> int:
    """A port free on 127.0.0.1 right now (the server binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
