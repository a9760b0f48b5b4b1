"""Which duplicates a run of kill -9s explains, from the results themselves (pure, no broker).

Worker process ``j`` is the one started after the ``j``-th kill (process 0 before the first). A result is
placed in the process that produced it by its output message's timestamp: the producer sets it when the
worker hands it the result, so a result of a killed process is stamped before that kill, whenever it
reached the broker, and the next process starts only after the kill (``after_kill`` sleeps a second first).

What at-least-once guarantees when nothing else goes wrong: a process produces each record's result once,
and a process started after a kill reads from the commit that kill left, so it produces again only
records at or past that commit. A second result is therefore explained only by a later process and an
offset at or past the commit read after the kill that preceded it.
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, kw_only=True)
class Copy:
    process: int
    partition: int
    offset: int


def copies(by_id: Mapping[str, Sequence[Mapping[str, Any]]], stamps: Mapping[str, Sequence[int]],
           kill_times: Sequence[float]) -> dict[str, list[Copy]]:
    """Each id's results as ``Copy``s, by process (``kill_times``: wall-clock seconds, in order)."""
    kills_ms = sorted(t * 1000.0 for t in kill_times)
    out: dict[str, list[Copy]] = {}
    for rid, values in by_id.items():
        out[rid] = sorted((Copy(process=bisect.bisect_left(kills_ms, ts), partition=v["source"]["partition"],
                                offset=v["source"]["offset"])
                           for v, ts in zip(values, stamps[rid], strict=True)), key=lambda c: c.process)
    return out


def windows(by_copy: Mapping[str, Sequence[Copy]],
            committed: Sequence[Mapping[int, int]]) -> list[dict[int, tuple[int, int]]]:
    """Per kill ``k``, per input partition: ``(commit read after it, one past the highest offset processes 0
    to k produced)``: what kill ``k`` left to be produced a second time. A commit of -1001 (none) is 0."""
    ends: list[dict[int, int]] = [{} for _ in committed]
    for cs in by_copy.values():
        for c in cs:
            for k in range(c.process, len(committed)):
                if c.offset >= ends[k].get(c.partition, 0):
                    ends[k][c.partition] = c.offset + 1
    return [{p: (max(cmt.get(p, 0), 0), end.get(p, 0)) for p in set(cmt) | set(end)}
            for cmt, end in zip(committed, ends, strict=True)]


def unexplained(by_copy: Mapping[str, Sequence[Copy]],
                committed: Sequence[Mapping[int, int]]) -> list[tuple[str, str]]:
    """``(id, why)`` for every id with a result the kills do not explain."""
    bad: list[tuple[str, str]] = []
    for rid, cs in sorted(by_copy.items()):
        seen: set[int] = set()
        for i, c in enumerate(cs):
            if c.process in seen:
                bad.append((rid, f"process {c.process} produced it twice ({c.partition}@{c.offset})"))
                break
            seen.add(c.process)
            if i == 0:
                continue
            start = max(committed[c.process - 1].get(c.partition, 0), 0) if c.process > 0 else 0
            if c.offset < start:
                bad.append((rid, f"process {c.process} produced {c.partition}@{c.offset} again, below the "
                                 f"commit {start} that kill {c.process} left"))
                break
    return bad
