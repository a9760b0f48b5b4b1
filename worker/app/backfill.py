"""``worker backfill``: offline batch inference over what the input topics hold now (seed 004).

Snapshots the end offsets of every input partition at start, processes until each partition reaches
its snapshot, commits, exits 0. Progress: a bar on a terminal (done/total, records/s, ETA), plain lines
every 10 s otherwise, then a summary. Killed, it resumes from the committed offsets of its group, with
``--from-beginning`` / ``--from-timestamp`` too (they only place the partitions the group has not committed
yet, or committed before that start point): a retried Job goes on where it stopped; a new ``--group`` starts
over.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any

import msgspec
from confluent_kafka import OFFSET_BEGINNING, Consumer
from confluent_kafka import TopicPartition as KTP

from worker.config.settings import Config
from worker.core.offsets import OffsetTracker
from worker.core.records import TopicPartition
from worker.kafka.access import check_access
from worker.kafka.clients import consumer_config, retry_transient
from worker.pipeline.runner import Runner


def snapshot(cfg: Config, group: str, from_timestamp: int | None = None) -> tuple[
        dict[TopicPartition, int], dict[TopicPartition, int], dict[TopicPartition, int]]:
    """(start offsets, end offsets, committed offsets of the group) for every input partition. The start is
    the low watermark, or with ``from_timestamp`` the first offset at or after it (the end if none)."""
    c = Consumer(consumer_config(cfg, group_id=group))
    try:
        md = c.list_topics(timeout=30)
        low: dict[TopicPartition, int] = {}
        end: dict[TopicPartition, int] = {}
        for topic in cfg.input_topics():
            t = md.topics.get(topic)
            if t is None or t.error is not None:
                raise SystemExit(f"backfill: input topic {topic!r} does not exist")
            for p in t.partitions:
                lo, hi = retry_transient(c.get_watermark_offsets, KTP(topic, p), timeout=30)
                low[TopicPartition(topic, p)] = lo
                end[TopicPartition(topic, p)] = hi
        committed = {TopicPartition(k.topic, k.partition): k.offset
                     for k in retry_transient(c.committed, [KTP(t, p) for t, p in end], timeout=30)
                     if k.offset >= 0}
        if from_timestamp is not None:
            found = retry_transient(c.offsets_for_times, [KTP(t, p, from_timestamp) for t, p in end],
                                    timeout=30)
            for k in found:
                tp = TopicPartition(k.topic, k.partition)
                low[tp] = k.offset if k.offset >= 0 else end[tp]
        return low, end, committed
    finally:
        c.close()


class Progress:
    def __init__(self, total: int, tty: bool) -> None:
        self.total = max(total, 0)
        self.tty = tty
        self.t0 = time.monotonic()
        self.last_line = 0.0

    def show(self, done: int, final: bool = False) -> None:
        now = time.monotonic()
        dt = max(now - self.t0, 1e-9)
        rate = done / dt
        eta = (self.total - done) / rate if rate > 0 else float("inf")
        eta_s = f"{eta:5.0f}s" if eta != float("inf") else "    ?"
        if self.tty:
            width = 30
            frac = done / self.total if self.total else 1.0
            bar = "#" * int(frac * width) + "-" * (width - int(frac * width))
            sys.stderr.write(f"\r[{bar}] {done}/{self.total} {rate:7.0f} rec/s ETA {eta_s}")
            if final:
                sys.stderr.write("\n")
            sys.stderr.flush()
        elif final or now - self.last_line >= 10:
            self.last_line = now
            print(f"backfill: {done}/{self.total} records, {rate:.0f} rec/s, ETA {eta_s.strip()}", flush=True)


class _CountingTracker(OffsetTracker):
    """Also counts the records read per partition (each offset once, a rewind's re-reads not again): between
    offsets there may be transaction markers, so offsets are no count of records."""

    __slots__ = ("read", "_top")

    def __init__(self) -> None:
        super().__init__()
        self.read: dict[TopicPartition, int] = {}
        self._top: dict[TopicPartition, int] = {}

    def track(self, tp: TopicPartition, offset: int) -> bool:
        if offset > self._top.get(tp, -1):
            self._top[tp] = offset
            self.read[tp] = self.read.get(tp, 0) + 1
        return super().track(tp, offset)

    def track_run(self, tp: TopicPartition, offsets: list[int]) -> bool:
        if not super().track_run(tp, offsets):
            return False  # the caller tracks them one at a time (counted by track)
        top = self._top.get(tp, -1)
        self._top[tp] = max(top, offsets[-1])
        self.read[tp] = self.read.get(tp, 0) + sum(1 for o in offsets if o > top)
        return True


class BackfillRunner(Runner):
    """A Runner that notes which partitions it finished: read up to the end snapshot, every record read done
    and committed. Noted at the end of its shutdown, after the last commit and before closing the consumer
    revokes the partitions and their state is forgotten.

    Not "committed offset == snapshot end": after a transactional producer's last record the end offset (high
    watermark) is one past its commit marker, which a consumer never returns, so the commit after the last
    record stays one short of it, on every rerun too."""

    finished: frozenset[TopicPartition] = frozenset()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tracker: _CountingTracker = _CountingTracker()

    def shutdown(self) -> int:
        rc = super().shutdown()
        behind = self.tracker.committable()  # done, not committed (the last commit failed)
        self.finished = frozenset(tp for tp in self.reached & self.assigned
                                  if self.tracker.first_pending(tp) is None and tp not in behind)
        return rc


def backfill(cfg: Config, from_beginning: bool = False, from_timestamp: int | None = None,
             group: str | None = None) -> int:
    group = group or f"{cfg.kafka.group_id}-backfill"
    check_access(cfg)  # a refused login or certificate: exit 2 naming the key, not 30 s of "cannot reach"
    explicit = from_beginning or from_timestamp is not None
    low, end, committed = snapshot(cfg, group, from_timestamp)
    # Where the group committed at or after the start point it goes on from its commit: a retried Job (same
    # arguments) resumes instead of starting over. Only partitions without such a commit start at the point.
    resumed = {tp for tp in end if committed.get(tp, -1) >= low[tp]}
    start = {tp: committed[tp] if tp in resumed else low[tp] for tp in end}
    reached = {tp for tp in end if start[tp] >= end[tp]}
    total = sum(max(end[tp] - start[tp], 0) for tp in end)

    def on_assign(consumer: Any, partitions: list[KTP]) -> None:
        for p in partitions:
            tp = TopicPartition(p.topic, p.partition)
            if tp not in start:
                # Added to an input topic after the end snapshot: all of it is past the end (left to the live
                # workers; the loop skips it), wherever it starts.
                continue
            done = runner.committed.get(tp, -1)
            if done > start[tp]:
                # Assigned again in this run (a lost assignment, a replaced consumer, a member that joined the
                # group and left): on from this run's commit, as a rerun would. From the start again,
                # everything done so far was processed twice.
                p.offset = done
                continue
            # Always the start chosen above, never auto.offset.reset: with "latest" and no commit the consumer
            # began at the end, read nothing, met EOF, and the backfill exited 0 with its range unprocessed.
            # librdkafka resolves OFFSET_BEGINNING itself, should retention have moved the low watermark.
            p.offset = start[tp] if (tp in resumed or not from_beginning) else OFFSET_BEGINNING
        # Explicit assign with the chosen offsets (eager protocol, forced below), instead of the automatic
        # one.
        consumer.assign(partitions)

    # EOF events tell a fully read partition apart from a slow one; the eager assignor makes the explicit
    # assign() above valid.
    cfg_eof = msgspec.structs.replace(cfg, kafka=msgspec.structs.replace(
        cfg.kafka, consumer={**cfg.kafka.consumer, "enable.partition.eof": True,
                             "partition.assignment.strategy": "range"}))
    runner = BackfillRunner(cfg_eof, stop_at=end, reached=reached, group_id=group, install_signals=True,
                            on_assign_offsets=on_assign)
    progress = Progress(total, sys.stderr.isatty())
    print(f"backfill: {total} records in {len(end)} partitions of {cfg.input_topics()} (group {group})",
          flush=True)
    if explicit and resumed:
        print(f"backfill: {len(resumed)} of {len(end)} partitions go on from the commits of group {group} "
              "(a new --group starts over)", flush=True)
    done_evt = threading.Event()

    def report() -> None:
        while not done_evt.wait(0.5):
            progress.show(_done(runner, start))

    reporter = threading.Thread(target=report, daemon=True)
    reporter.start()
    rc = runner.run()
    done_evt.set()
    finished = reached | runner.finished
    short = [tp for tp in end if tp not in finished]
    if rc == 0 and short:
        # Stopped (SIGTERM/SIGINT) before the end: not a success, or a Job would count it done and never
        # resume.
        print(f"backfill: stopped before the end of {len(short)} of {len(end)} partitions; run it again to "
              "go on from the committed offsets", flush=True)
        rc = 1
    reporter.join(2)
    # Offsets so far; a transactional producer's commit markers take offsets too (one per transaction and
    # partition), so a finished partition counts the records it read instead.
    read = runner.tracker.read
    progress.total = sum(read.get(tp, 0) if tp in finished else max(end[tp] - start[tp], 0) for tp in end)
    done = sum(read.get(tp, 0) if tp in finished else max(runner.committed.get(tp, start[tp]) - start[tp], 0)
               for tp in end)
    progress.show(done, final=True)
    st = runner.stats
    dt = time.monotonic() - progress.t0
    print(f"backfill summary: {st.records_in} records read, {st.results_ok} ok, {st.results_error} error, "
          f"{st.results_expired} expired, {st.dlq} dead letters, {st.batches} batches "
          f"(mean {st.mean_batch:.1f}), {st.records_in / dt if dt else 0:.0f} rec/s, {dt:.1f}s, exit {rc}",
          flush=True)
    return rc


def _done(runner: Any, start: dict[TopicPartition, int]) -> int:
    # Committed progress, so the bar never shows records that a crash would redo.
    return sum(max(runner.committed.get(tp, start[tp]) - start[tp], 0) for tp in start)
