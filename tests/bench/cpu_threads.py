"""CPU time by thread class, read from ``/proc``: a worker (or a supervisor and its children), the broker.

The worker names its threads (``kiw-collate``, ``kiw-device``, ``kiw-finish``, ``kiw-host``); librdkafka's
are ``rdk:*``; a worker process's main thread is its loop thread; a supervisor's own threads are
"supervisor". The rest ("tokenizer + other") is mostly the tokenizer's Rust thread pool (its threads keep
the process's name) and torch's. The broker is found by the port of the bootstrap address it listens on
(a local broker on this machine; an external one reads as absent), and counts as one class: on a machine
it shares with the worker, its CPU per record is part of what bounds the worker.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")
_NAMED = (("kiw-collate", "collate"), ("kiw-device", "device"), ("kiw-finish", "finish"),
          ("kiw-host", "host pool"), ("rdk:", "librdkafka"))
OTHER = "tokenizer + other"
BROKER = "broker"


def thread_class(tid: int, pid: int, comm: str, *, supervisor: bool = False) -> str:
    if tid == pid:
        return "supervisor" if supervisor else "loop"
    if supervisor:
        return "supervisor"
    for prefix, cls in _NAMED:
        if comm.startswith(prefix):
            return cls
    return OTHER


def _stat_s(path: Path) -> float:
    fields = path.read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def process_cpu(pid: int, out: dict[str, float], *, supervisor: bool = False) -> None:
    """Adds the CPU seconds of every thread of ``pid`` to ``out`` by class."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return  # the process ended
    for task in tasks:
        try:
            comm = (task / "comm").read_text().strip()
            cpu = _stat_s(task / "stat")
        except (OSError, IndexError, ValueError):
            continue  # the thread ended meanwhile
        cls = thread_class(int(task.name), pid, comm, supervisor=supervisor)
        out[cls] = out.get(cls, 0.0) + cpu


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _listen_inodes(port: int) -> set[str]:
    inodes: set[str] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if len(f) > 9 and f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f[9])
    return inodes


def broker_pid(bootstrap: str) -> int | None:
    """The pid of the process listening on the first bootstrap address's port, if it is on this machine
    and readable; None otherwise."""
    try:
        port = int(bootstrap.split(",")[0].rsplit(":", 1)[1])
    except (IndexError, ValueError):
        return None
    wanted = {f"socket:[{i}]" for i in _listen_inodes(port)}
    if not wanted:
        return None
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            for fd in (proc / "fd").iterdir():
                if os.readlink(fd) in wanted:
                    return int(proc.name)
        except OSError:
            continue
    return None


class CpuProbe:
    """CPU seconds by thread class of a worker process tree and of the broker, at each ``sample()``.

    ``supervised``: the worker's pid is a supervisor (``model.processes`` > 1); its children's threads are
    classed as a worker's, its own as "supervisor"."""

    def __init__(self, worker_pid: int, bootstrap: str, *, supervised: bool = False) -> None:
        self.pid = worker_pid
        self.supervised = supervised
        self.broker = broker_pid(bootstrap)

    def sample(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self.supervised:
            process_cpu(self.pid, out, supervisor=True)
            for kid in children(self.pid):
                process_cpu(kid, out)
        else:
            process_cpu(self.pid, out)
        if self.broker is not None:
            b: dict[str, float] = {}
            process_cpu(self.broker, b, supervisor=True)
            out[BROKER] = sum(b.values())
        return out


def per_record_us(before: dict[str, float], after: dict[str, float], n: int) -> dict[str, float]:
    """CPU microseconds per record by class between two samples; ``total`` is the worker's (the broker
    apart), ``with broker`` adds it."""
    keys = sorted(set(before) | set(after))
    out = {k: (after.get(k, 0.0) - before.get(k, 0.0)) / max(n, 1) * 1e6 for k in keys}
    broker = out.pop(BROKER, None)
    out["total"] = sum(out.values())
    if broker is not None:
        out[BROKER] = broker
        out["with broker"] = out["total"] + broker
    return out


def cpu_note(cpu: dict[str, float]) -> str:
    return "CPU us/record: " + ", ".join(f"{k} {v:.1f}" for k, v in cpu.items())


def idle_cores(pid: int | None, seconds: float = 2.0) -> float:
    """The cores process ``pid`` keeps busy over ``seconds`` (a broker with no traffic: its own timers,
    controller and GC); NaN without a pid."""
    if pid is None:
        return float("nan")
    before: dict[str, float] = {}
    process_cpu(pid, before)
    t = time.monotonic()
    time.sleep(seconds)
    after: dict[str, float] = {}
    process_cpu(pid, after)
    return (sum(after.values()) - sum(before.values())) / (time.monotonic() - t)
