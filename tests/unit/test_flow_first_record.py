"""Backpressure leaves a partition reading until it returns its first record.

librdkafka looks up where a partition without a commit starts (``auto.offset.reset``) after the assignment,
and a pause and resume during that lookup can make it run the lookup twice: the partition's first records
come again after the worker processed them, and each gets a second result (seen in the kill -9 chaos test;
design notes: "A partition's first records read twice"). So the in-flight bound and a full lane pause only
partitions that have returned a record in their current assignment.
"""

from __future__ import annotations

import pytest

from tests.unit.fakes_kafka import Harness, make_config
from worker.core.records import TopicPartition

IN0, IN1 = TopicPartition("in", 0), TopicPartition("in", 1)


def at_the_bound(monkeypatch: pytest.MonkeyPatch) -> Harness:
    """in/0 and in/1 assigned; in/0 reads up to max_in_flight 10, in/1 has nothing yet."""
    cfg = make_config(kafka={"poll_max_records": 4},
                      batching={"max_in_flight": 10, "resume_ratio": 0.5,
                                "lanes": [{"name": "default", "max_batch_size": 2, "max_wait_ms": 60_000}]})
    h = Harness(monkeypatch, cfg).start()
    h.c.assign(("in", 0), ("in", 1))
    h.send(14, partition=0)
    h.iterate(3)
    assert h.runner.tracker.in_flight() == 10
    return h


def test_a_partition_without_a_record_is_not_paused_at_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    h = at_the_bound(monkeypatch)
    assert h.c.paused == {IN0}
    assert all(IN1 not in call for call in h.c.pause_calls)
    assert h.runner.partitions.paused == {IN0}


def test_it_pauses_with_its_first_record_one_past_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    h = at_the_bound(monkeypatch)
    h.send(5, partition=1)
    h.iterate()  # at the bound a poll reads one record: in/1's first
    assert h.runner.tracker.in_flight() == 11
    assert h.c.paused == {IN0, IN1} and h.runner.partitions.paused == {IN0, IN1}
    h.iterate(3)
    assert h.runner.tracker.in_flight() == 11  # both paused: nothing more is read

