"""Count-, token- or time-bounded micro-batching for one lane.

Why: a device does far more work per second on a batch of N records than on N single records, but a
record should not wait long for company, and device memory grows with the tokens in a batch, not its
records. A window opens with its first record and closes when it holds ``max_batch_size`` records
(reason ``"count"``), when the next record would take it over ``max_batch_tokens`` (reason ``"tokens"``:
that record opens the next window), or when its first record has waited ``max_wait_s`` (reason
``"time"``), whichever comes first. ``flush`` closes everything (``"flush"``, shutdown or end of a
backfill) and ``take_open`` closes the oldest window early (``"idle"``: the scheduler's work-conserving
dispatch when a device would otherwise sit idle).

A record's cost is ``record.size`` (the handler's ``size_of``, e.g. its token count), at least 1, so on a
model without ``size_of`` a token budget is a count. A record that costs more than the budget on its own
runs alone: its window closes at once with only it.

With ``bucket_width > 0`` records are grouped by ``record.size // bucket_width`` (e.g. token count), one
window per bucket, so a batch pads to similar lengths instead of to the longest record in the lane.

Guarantees:

- every record added comes out exactly once: in a returned batch or from ``remove``;
- a returned batch is never empty, never larger than the effective max batch size at the time it was
  closed, never costs more than the effective token budget then unless it is one record alone, holds
  records of one bucket only, in arrival order;
- windows close in the order they opened (``poll``), so no record is overtaken by a later one of its
  own bucket.

Pure: time is passed in as ``now`` (monotonic seconds, non-decreasing between calls); no clocks, no
threads. ``add`` is O(1); ``poll`` is O(windows closed); ``remove`` is O(records held).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from worker.core.records import Batch, Record


def cost(record: Record) -> int:
    """What a record takes of a token budget: its size, at least 1 (so every budget bounds the count)."""
    s = record.size
    return s if s > 1 else 1


def fitting(recs: Sequence[Record], count: int, tokens: int | None, lone: bool = True) -> int:
    """How many records from the front of ``recs`` go in one batch of at most ``count`` records and
    ``tokens`` cost (None: no budget). With ``lone``, a first record over the budget goes alone."""
    n = min(count, len(recs))
    if tokens is None:
        return n
    total = 0
    for i in range(n):
        total += cost(recs[i])
        if total > tokens:
            return 1 if i == 0 and lone else i
    return n


class _Window:
    __slots__ = ("opened_at", "records", "tokens")

    def __init__(self, opened_at: float) -> None:
        self.opened_at = opened_at
        self.records: list[Record] = []
        self.tokens = 0  # the cost of ``records``


class MicroBatcher:
    """The open windows of one lane (one per size bucket)."""

    __slots__ = ("lane", "max_wait_s", "bucket_width", "_max", "_tok", "_windows", "_n", "_oversized")

    def __init__(self, lane: str, max_batch_size: int, max_wait_s: float, bucket_width: int = 0,
                 max_batch_tokens: int | None = None) -> None:
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if not max_wait_s >= 0:  # also rejects NaN
            raise ValueError(f"max_wait_s must be >= 0, got {max_wait_s}")
        if bucket_width < 0:
            raise ValueError(f"bucket_width must be >= 0 (0 = no bucketing), got {bucket_width}")
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1 (or None: no budget), got {max_batch_tokens}")
        self.lane = lane
        self.max_wait_s = float(max_wait_s)
        self.bucket_width = bucket_width
        self._max = max_batch_size
        self._tok = max_batch_tokens
        # Insertion order == opening order (``now`` never goes backwards), so the first window is the
        # oldest: poll, take_open and next_deadline look at the front only. OrderedDict keeps
        # next(iter(...)) O(1) after many deletions, which a plain dict does not.
        self._windows: OrderedDict[int, _Window] = OrderedDict()
        self._n = 0
        self._oversized = False  # set when a limit was lowered below a window's size

    # ------------------------------------------------------------------ properties
    @property
    def max_batch_size(self) -> int:
        return self._max

    @property
    def max_batch_tokens(self) -> int | None:
        """The token budget in force (None: none)."""
        return self._tok

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
        """Add one record; returns the batches its arrival closed by count or tokens (usually none)."""
        bw = self.bucket_width
        key = record.size // bw if bw else 0
        windows = self._windows
        w = windows.get(key)
        tok = self._tok
        out: list[Batch] = []
        if tok is not None:
            c = record.size if record.size > 1 else 1
            if w is not None and w.tokens + c > tok and not self._oversized:
                # It does not fit: its window closes without it, and it opens the next one.
                del windows[key]
                self._n -= len(w.records)
                out.append(Batch(self.lane, w.records, w.opened_at, now, "tokens", self._max))
                w = None
        if w is None:
            w = windows[key] = _Window(now)
        recs = w.records
        recs.append(record)
        if tok is not None:
            w.tokens += c
        self._n += 1
        if self._oversized:
            return self._close_full(now)
        if len(recs) >= self._max or (tok is not None and w.tokens >= tok):
            del windows[key]
            self._n -= len(recs)
            reason = "count" if len(recs) >= self._max else "tokens"
            out.append(Batch(self.lane, recs, w.opened_at, now, reason, self._max))
        return out

    def poll(self, now: float) -> list[Batch]:
        """Batches whose window's first record arrived ``max_wait_s`` or more ago (and, after a limit was
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
    def take_open(self, now: float, limit: int, reason: str = "idle",
                  tokens: int | None = None) -> Batch | None:
        """Close the oldest open window now, taking at most ``min(limit, max_batch_size)`` of its records
        and at most the token budget of them (the rest stay open, keeping the window's ``opened_at``).

        ``tokens``: the room left in a batch being filled; then a first record that does not fit in it
        is not taken (None is returned when nothing fits). Without it, a first record over the budget
        goes alone."""
        if not self._windows:
            return None
        n = min(limit, self._max)
        if n < 1:
            raise ValueError(f"limit must be >= 1, got {limit}")
        key = next(iter(self._windows))
        w = self._windows[key]
        tok = self._tok
        if tokens is not None:
            tok = tokens if tok is None else min(tok, tokens)
        if tok is not None:
            n = fitting(w.records, n, tok, lone=tokens is None)
            if n == 0:
                return None
        if len(w.records) <= n:
            del self._windows[key]
            recs = w.records
        else:
            recs = w.records[:n]
            del w.records[:n]
            if self._tok is not None:
                w.tokens -= sum(cost(r) for r in recs)
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
                    w.tokens = sum(cost(r) for r in kept) if self._tok is not None else 0
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

    def set_max_batch_tokens(self, tokens: int | None) -> None:
        """Change the effective token budget (None: none). Windows over a lowered budget close, split
        into batches within it, on the next ``add`` or ``poll``."""
        if tokens is not None and tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1 (or None: no budget), got {tokens}")
        if tokens is not None and self._windows and (self._tok is None or tokens < self._tok):
            self._oversized = True
        if tokens is not None and self._tok is None:
            for w in self._windows.values():
                w.tokens = sum(cost(r) for r in w.records)
        self._tok = tokens

    # ------------------------------------------------------------------ internals
    def _emit(self, opened_at: float, recs: list[Record], now: float, reason: str, out: list[Batch]) -> None:
        self._n -= len(recs)
        m, tok = self._max, self._tok
        if len(recs) <= m and (tok is None or len(recs) == 1 or sum(cost(r) for r in recs) <= tok):
            out.append(Batch(self.lane, recs, opened_at, now, reason, m))
            return
        i = 0
        while i < len(recs):
            j = i + fitting(recs[i:i + m], m, tok)
            out.append(Batch(self.lane, recs[i:j], opened_at, now, reason, m))
            i = j

    def _close_full(self, now: float) -> list[Batch]:
        """Cut every window holding a full batch (max records, or the token budget reached) into full
        batches; a remainder stays open."""
        self._oversized = False
        out: list[Batch] = []
        m, tok = self._max, self._tok
        for key in list(self._windows):
            w = self._windows[key]
            recs = w.records
            i = 0
            while i < len(recs):
                k = fitting(recs[i:i + m], m, tok)
                full = k == m or i + k < len(recs)  # the next record does not fit, or count reached
                if not full and tok is not None:
                    full = sum(cost(r) for r in recs[i:i + k]) >= tok
                if not full:
                    break
                reason = "count" if k == m else "tokens"
                out.append(Batch(self.lane, recs[i:i + k], w.opened_at, now, reason, m))
                i += k
            if i == 0:
                continue
            self._n -= i
            if i == len(recs):
                del self._windows[key]
            else:
                w.records = recs[i:]
                if tok is not None:
                    w.tokens = sum(cost(r) for r in w.records)
        return out
