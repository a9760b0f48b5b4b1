"""Count-or-time micro-batching for one lane.

Why: a device does far more work per second on a batch of N records than on N single records, but a
record should not wait long for company. A window opens with its first record and closes when it holds
``max_batch_size`` records (reason ``"count"``) or when its first record has waited ``max_wait_s``
(reason ``"time"``), whichever comes first. ``flush`` closes everything (``"flush"``, shutdown or end of a
backfill) and ``take_open`` closes the oldest window early (``"idle"``: the scheduler's work-conserving
dispatch when a device would otherwise sit idle).

With ``bucket_width > 0`` records are grouped by ``record.size // bucket_width`` (e.g. token count), one
window per bucket, so a batch pads to similar lengths instead of to the longest record in the lane.

Guarantees:

- every record added comes out exactly once: in a returned batch or from ``remove``;
- a returned batch is never empty, never larger than the effective max batch size at the time it was
  closed, holds records of one bucket only, in arrival order;
- windows close in the order they opened (``poll``), so no record is overtaken by a later one of its
  own bucket.

Pure: time is passed in as ``now`` (monotonic seconds, non-decreasing between calls); no clocks, no
threads. ``add`` is O(1); ``poll`` is O(windows closed); ``remove`` is O(records held).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

from worker.core.records import Batch, Record


class _Window:
    __slots__ = ("opened_at", "records")

    def __init__(self, opened_at: float) -> None:
        self.opened_at = opened_at
        self.records: list[Record] = []


class MicroBatcher:
    """The open windows of one lane (one per size bucket)."""

    __slots__ = ("lane", "max_wait_s", "bucket_width", "_max", "_windows", "_n", "_oversized")

    def __init__(self, lane: str, max_batch_size: int, max_wait_s: float, bucket_width: int = 0) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if not max_wait_s >= 0:  # also rejects NaN
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        if bucket_width < 0:
            raise ValueError(f"bucket_width must be >= 0 (0 = no bucketing), got {bucket_width}")
        self.lane = lane
        self.max_wait_s = float(max_wait_s)
        self.bucket_width = bucket_width
        self._max = max_batch_size
        # Insertion order == opening order (``now`` never goes backwards), so the first window is the
        # oldest: poll, take_open and next_deadline look at the front only. OrderedDict keeps
        # next(iter(...)) O(1) after many deletions, which a plain dict does not.
        self._windows: OrderedDict[int, _Window] = OrderedDict()
        self._n = 0
        self._oversized = False  # set when the max was lowered below a window's size

    # ------------------------------------------------------------------ properties
    @property
    def max_batch_size(self) -> int:
        return self._max

    def __len__(self) -> int:
        """Records held in open windows."""
        return self._n

    @property
    def open_windows(self) -> int:
        return len(self._windows)

    def bucket_of(self, record: Record) -> int:
        return record.size // self.bucket_width if self.bucket_width else 0

    # ------------------------------------------------------------------ hot path
    def add(self, record: Record, now: float) -> list[Batch]:
        """Add one record; returns the batches its arrival closed by count (usually none)."""
        bw = self.bucket_width
        key = record.size // bw if bw else 0
        windows = self._windows
        w = windows.get(key)
        if w is None:
            w = windows[key] = _Window(now)
        recs = w.records
        recs.append(record)
        self._n += 1
        if self._oversized:
            return self._close_full(now)
        if len(recs) >= self._max:
            del windows[key]
            self._n -= len(recs)
            return [Batch(self.lane, recs, w.opened_at, now, "count", self._max)]
        return []

    def poll(self, now: float) -> list[Batch]:
        """Batches whose window's first record arrived ``max_wait_s`` or more ago (and, after the max was
        lowered, full windows)."""
        out = self._close_full(now) if self._oversized else []
        windows = self._windows
        mw = self.max_wait_s
        while windows:
            key = next(iter(windows))
            w = windows[key]
            if w.opened_at + mw > now:
                break
            del windows[key]
            self._emit(w.opened_at, w.records, now, "time", out)
        return out

    def next_deadline(self) -> float | None:
        """Earliest time a window closes by time (None when nothing is held). May be in the past."""
        if not self._windows:
            return None
        first = self._windows[next(iter(self._windows))]
        if self._oversized:
            return first.opened_at  # due now: poll splits the oversized windows
        return first.opened_at + self.max_wait_s

    def peek_oldest(self) -> tuple[float, list[Record]] | None:
        """(opened_at, records) of the oldest open window, without closing it. Do not mutate the list."""
        if not self._windows:
            return None
        w = self._windows[next(iter(self._windows))]
        return w.opened_at, w.records

    # ------------------------------------------------------------------ early / forced closing
    def take_open(self, now: float, limit: int, reason: str = "idle") -> Batch | None:
        """Close the oldest open window now, taking at most ``min(limit, max_batch_size)`` of its records
        (the rest stay open, keeping the window's ``opened_at``)."""
        if not self._windows:
            return None
        n = min(limit, self._max)
        if n < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        key = next(iter(self._windows))
        w = self._windows[key]
        if len(w.records) <= n:
            del self._windows[key]
            recs = w.records
        else:
            recs = w.records[:n]
            del w.records[:n]
        self._n -= len(recs)
        return Batch(self.lane, recs, w.opened_at, now, reason, self._max)

    def flush(self, now: float) -> list[Batch]:
        """Close every window (oldest first). Never returns an empty batch."""
        out: list[Batch] = []
        windows = self._windows
        while windows:
            _, w = windows.popitem(last=False)
            self._emit(w.opened_at, w.records, now, "flush", out)
        self._oversized = False
        return out

    def remove(self, pred: Callable[[Record], bool], limit: int | None = None) -> list[Record]:
        """Drop and return the held records matching ``pred`` (revoked partitions, expired records).
        With ``limit``, stop scanning once that many were removed (the caller knows how many to find).
        Windows keep their ``opened_at`` (so they close no later than planned); emptied windows go."""
        removed: list[Record] = []
        for key in list(self._windows):
            w = self._windows[key]
            kept = []
            for r in w.records:
                if pred(r):
                    removed.append(r)
                else:
                    kept.append(r)
            if len(kept) != len(w.records):
                if kept:
                    w.records = kept
                else:
                    del self._windows[key]
            if limit is not None and len(removed) >= limit:
                break
        self._n -= len(removed)
        return removed

    def set_max_batch_size(self, n: int) -> None:
        """Change the effective max (OOM handling lowers it, later raises it back). Windows that are now
        full close, split into batches of at most ``n``, on the next ``add`` or ``poll``."""
        if n < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {n}")
        if n < self._max and self._windows:
            self._oversized = True
        self._max = n

    # ------------------------------------------------------------------ internals
    def _emit(self, opened_at: float, recs: list[Record], now: float, reason: str, out: list[Batch]) -> None:
        self._n -= len(recs)
        m = self._max
        if len(recs) <= m:
            out.append(Batch(self.lane, recs, opened_at, now, reason, m))
            return
        for i in range(0, len(recs), m):
            out.append(Batch(self.lane, recs[i:i + m], opened_at, now, reason, m))

    def _close_full(self, now: float) -> list[Batch]:
        """Cut every window holding >= max records into full batches; a remainder stays open."""
        self._oversized = False
        out: list[Batch] = []
        m = self._max
        for key in list(self._windows):
            w = self._windows[key]
            recs = w.records
            if len(recs) < m:
                continue
            full = len(recs) - len(recs) % m
            for i in range(0, full, m):
                out.append(Batch(self.lane, recs[i:i + m], w.opened_at, now, "count", m))
            self._n -= full
            if full == len(recs):
                del self._windows[key]
            else:
                w.records = recs[full:]
        return out
