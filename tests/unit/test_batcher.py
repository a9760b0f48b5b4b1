from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.props import examples
from tests.unit.batching_ops import BatcherPlay
from tests.unit.fakes import ids, rec, recs
from worker.core.batcher import MicroBatcher
from worker.core.records import Batch, TopicPartition


def test_closes_by_count_in_arrival_order() -> None:
    b = MicroBatcher("default", max_batch_size=3, max_wait_s=1.0)
    rs = recs(7)
    out: list[Batch] = []
    for i, r in enumerate(rs):
        out += b.add(r, now=float(i) * 0.01)
    assert [len(x) for x in out] == [3, 3]
    assert [x.reason for x in out] == ["count", "count"]
    assert ids(out[0].records) == ids(rs[:3]) and ids(out[1].records) == ids(rs[3:6])
    assert out[0].opened_at == 0.0 and out[0].closed_at == pytest.approx(0.02)
    assert out[0].max_batch_size == 3 and out[0].fill_ratio == 1.0
    assert len(b) == 1


def test_closes_by_time_from_first_record() -> None:
    b = MicroBatcher("default", max_batch_size=10, max_wait_s=0.010)
    first, second = rec(), rec()
    assert b.add(first, 100.0) == []
    assert b.add(second, 100.008) == []
    assert b.next_deadline() == pytest.approx(100.010)
    assert b.poll(100.009) == []
    (batch,) = b.poll(100.010)
    assert batch.reason == "time" and batch.records == [first, second]
    assert batch.opened_at == 100.0 and batch.closed_at == 100.010
    assert len(b) == 0 and b.next_deadline() is None and b.poll(200.0) == []


def test_max_wait_zero_closes_at_next_poll() -> None:
    b = MicroBatcher("default", 8, 0.0)
    b.add(rec(), 5.0)
    assert b.next_deadline() == 5.0
    assert [len(x) for x in b.poll(5.0)] == [1]


def test_max_batch_one_closes_every_record() -> None:
    b = MicroBatcher("default", 1, 1.0)
    assert [len(x) for x in b.add(rec(), 0.0)] == [1]
    assert len(b) == 0


def test_flush_closes_everything_never_empty() -> None:
    b = MicroBatcher("default", 4, 10.0, bucket_width=10)
    assert b.flush(0.0) == []
    b.add(rec(size=1), 0.0)
    b.add(rec(size=15), 0.1)
    b.add(rec(size=2), 0.2)
    out = b.flush(0.3)
    assert [x.reason for x in out] == ["flush", "flush"]
    assert [len(x) for x in out] == [2, 1]  # oldest window first
    assert len(b) == 0 and b.flush(0.4) == []


def test_bucketing_keeps_sizes_within_a_bucket() -> None:
    b = MicroBatcher("default", 2, 10.0, bucket_width=8)
    out: list[Batch] = []
    for size in [1, 9, 3, 30, 12, 7, 31]:
        out += b.add(rec(size=size), 0.0)
    out += b.flush(1.0)
    for batch in out:
        assert len({r.size // 8 for r in batch.records}) == 1
    assert sorted(len(x) for x in out) == [1, 2, 2, 2]
    assert [r.size for r in out[0].records] == [1, 3]  # bucket 0 filled first


def test_poll_closes_windows_in_opening_order() -> None:
    b = MicroBatcher("default", 10, 1.0, bucket_width=10)
    b.add(rec(size=50), 0.0)
    b.add(rec(size=5), 0.5)
    b.add(rec(size=55), 0.6)  # joins the first window
    assert [len(x) for x in b.poll(1.0)] == [2]
    assert b.next_deadline() == 1.5
    assert [x.records[0].size for x in b.poll(2.0)] == [5]


def test_take_open_closes_the_oldest_window_early() -> None:
    b = MicroBatcher("default", 10, 1.0, bucket_width=10)
    old = recs(3, size=25)
    for r in old:
        b.add(r, 0.0)
    b.add(rec(size=1), 0.1)
    batch = b.take_open(0.2, limit=2)
    assert batch is not None and batch.reason == "idle" and batch.records == old[:2]
    assert batch.closed_at == 0.2 and batch.opened_at == 0.0
    batch = b.take_open(0.3, limit=10)
    assert batch is not None and batch.records == old[2:]
    batch = b.take_open(0.3, limit=10, reason="adaptive")
    assert batch is not None and batch.reason == "adaptive" and batch.records[0].size == 1
    assert b.take_open(0.4, limit=10) is None and len(b) == 0


def test_remove_drops_matching_records_and_empty_windows() -> None:
    b = MicroBatcher("default", 10, 1.0, bucket_width=10)
    a = rec(partition=0, size=1)
    c = rec(partition=1, size=1)
    d = rec(partition=1, size=50)
    for r in (a, c, d):
        b.add(r, 0.0)
    removed = b.remove(lambda r: r.tp == TopicPartition("in", 1))
    assert removed == [c, d]
    assert len(b) == 1 and b.open_windows == 1
    assert b.flush(1.0)[0].records == [a]


def test_lowering_max_splits_open_windows_on_next_poll() -> None:
    b = MicroBatcher("default", 8, 1.0)
    rs = recs(7)
    for r in rs:
        b.add(r, 0.0)
    b.set_max_batch_size(3)
    assert b.max_batch_size == 3
    assert b.next_deadline() == 0.0  # due now
    out = b.poll(0.1)
    assert [len(x) for x in out] == [3, 3] and all(x.reason == "count" and x.max_batch_size == 3 for x in out)
    assert ids(out[0].records + out[1].records) == ids(rs[:6])
    assert len(b) == 1
    assert b.next_deadline() == 1.0  # the remainder keeps its window's age
    b.set_max_batch_size(8)  # raising back: nothing to split
    assert b.add(rec(), 0.2) == []


def test_lowering_max_splits_on_next_add() -> None:
    b = MicroBatcher("default", 8, 1.0)
    for r in recs(5):
        b.add(r, 0.0)
    b.set_max_batch_size(2)
    out = b.add(rec(), 0.1)
    assert [len(x) for x in out] == [2, 2, 2] and len(b) == 0


def test_flush_after_lowering_never_exceeds_max() -> None:
    b = MicroBatcher("default", 8, 1.0)
    for r in recs(7):
        b.add(r, 0.0)
    b.set_max_batch_size(3)
    assert [len(x) for x in b.flush(0.0)] == [3, 3, 1]


@pytest.mark.parametrize("kw", [{"max_batch_size": 0}, {"max_wait_s": -1.0}, {"bucket_width": -1},
                                {"max_wait_s": float("nan")}])
def test_rejects_bad_settings(kw: dict[str, float]) -> None:
    args = {"lane": "x", "max_batch_size": 4, "max_wait_s": 0.01, **kw}
    with pytest.raises(ValueError, match=next(iter(kw))):
        MicroBatcher(**args)  # type: ignore[arg-type]


# ---------------------------------------------------------------- properties

ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(0, 40), st.floats(0, 0.02)),
        st.tuples(st.just("poll"), st.just(0), st.floats(0, 0.05)),
        st.tuples(st.just("take"), st.integers(1, 9), st.floats(0, 0.01)),
        st.tuples(st.just("max"), st.integers(1, 9), st.just(0.0)),
        st.tuples(st.just("remove"), st.integers(0, 3), st.just(0.0)),
    ),
    max_size=120,
)


@settings(max_examples=examples(250), deadline=None)
@given(ops=ops, max_batch=st.integers(1, 8), max_wait=st.sampled_from([0.0, 0.005, 0.02]),
       bucket=st.sampled_from([0, 10]))
def test_every_record_out_exactly_once_batches_valid(ops: list[tuple[str, int, float]], max_batch: int,
                                                     max_wait: float, bucket: int) -> None:
    def check(x: Batch, op: str, arg: int) -> None:
        assert len(x) <= x.max_batch_size
        assert x.lane == "L"
        if op == "take":
            assert len(x) <= arg

    play = BatcherPlay(MicroBatcher("L", max_batch, max_wait, bucket_width=bucket), bucket, check)
    for op, arg, dt in ops:
        play.apply(op, arg, dt)
    play.finish()
