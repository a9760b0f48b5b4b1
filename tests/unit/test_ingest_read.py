"""Ingest.read: a poll batch's records tracked once per partition (DeliveryMode.track_run) keep what tracking
them one at a time in the order read gives: the same records processed, positions, tracker and reorder
buffer state, in both delivery modes, whatever order the offsets come in (a position moved back, a record
read twice after a rewind)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.support.props import examples
from tests.unit.fakes_kafka import FakeMessage
from worker.core.offsets import OffsetTracker
from worker.core.records import TopicPartition
from worker.output.transactions import TransactionalCommitter
from worker.pipeline.delivery import AtLeastOnce, DeliveryMode
from worker.pipeline.exactly_once import ExactlyOnce
from worker.pipeline.ingest import Ingest
from worker.pipeline.partitions import PartitionTable

TPS = [TopicPartition("in", 0), TopicPartition("in", 1)]


def _msg(partition: int, offset: int) -> FakeMessage:
    return FakeMessage("in", partition, offset, b"{}", b"k", timestamp_ms=1_000 + offset)


def _mode(kind: str) -> DeliveryMode:
    loop: Any = SimpleNamespace(partitions=PartitionTable(), tracker=OffsetTracker(), stop_at=None,
                                clock=SimpleNamespace(monotonic=lambda: 0.0))
    loop.partitions.assign(TPS)
    if kind == "at_least_once":
        return AtLeastOnce(loop, make_producer=lambda *a, **k: None)
    mode = ExactlyOnce(loop, make_producer=lambda *a, **k: None, group_id="g")
    mode.txn = TransactionalCommitter(None, None)
    return mode


def _state(mode: DeliveryMode) -> tuple[Any, ...]:
    t, parts = mode.tracker, mode.loop.partitions
    txn = getattr(mode, "txn", None)
    return (t.committable(), t.in_flight(), [(t.pending(tp), t.first_pending(tp), t.span(tp)) for tp in TPS],
            [(parts.live(tp).position, parts.live(tp).first_read) for tp in TPS],  # type: ignore[union-attr]
            {tp: list(q) for tp, q in txn.order.items()} if txn is not None else None)


def _one_at_a_time(mode: DeliveryMode, batch: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The records processed when each is tracked on its own, as it is read."""
    kept = []
    for p, o in batch:
        part = mode.loop.partitions.live(TPS[p])
        assert part is not None
        if mode.track(part, o):
            part.position = o + 1
            kept.append((p, o))
    return kept


_batches = st.lists(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 12)), max_size=10), max_size=4)


@settings(max_examples=examples(200), deadline=None)
@given(st.sampled_from(["at_least_once", "exactly_once"]), _batches)
@example("exactly_once", [[(0, 5), (0, 6), (0, 5), (0, 7)]])  # 5 read twice: the second one is dropped
@example("at_least_once", [[(0, 3), (0, 4), (1, 0), (0, 1), (0, 2)]])  # partition 0 moved back to 1
def test_a_batch_tracked_per_partition_is_one_tracked_record_by_record(
        kind: str, batches: list[list[tuple[int, int]]]) -> None:
    ref, mode = _mode(kind), _mode(kind)
    ingest = Ingest(mode.loop, mode, results=None)  # type: ignore[arg-type]
    for batch in batches:
        want = _one_at_a_time(ref, batch)
        recs = ingest.read([_msg(p, o) for p, o in batch], now=1.0)
        assert [(r.tp.partition, r.offset) for r in recs] == want
        assert all(r.tp is mode.loop.partitions.live(r.tp).tp and r.received_at == 1.0  # type: ignore[union-attr]
                   and r.produced_at_ms == 1_000 + r.offset for r in recs)
        assert _state(mode) == _state(ref)


def test_a_revoked_partitions_messages_and_a_backfills_records_past_its_end_are_not_read() -> None:
    mode = _mode("at_least_once")
    mode.loop.partitions.release([TPS[1]])
    mode.loop.stop_at = {TPS[0]: 2}
    recs = Ingest(mode.loop, mode, results=None).read(  # type: ignore[arg-type]
        [_msg(0, 0), _msg(1, 0), _msg(0, 1), _msg(0, 2), _msg(1, 1)], now=0.0)
    assert [(r.tp.partition, r.offset) for r in recs] == [(0, 0), (0, 1)]
    part = mode.loop.partitions.live(TPS[0])
    assert part is not None and part.reached and part.position == 2 and mode.tracker.in_flight() == 2
