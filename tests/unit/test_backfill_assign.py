"""worker backfill's assignment hook (backfill.on_assign), driven through backfill() on the fakes: the start
offsets it chooses, and a partition added to an input topic while the backfill runs."""
from __future__ import annotations

import pytest
from confluent_kafka import OFFSET_BEGINNING

import worker.app.backfill as bf
import worker.pipeline.runner as wr
from tests.unit.fakes_kafka import Harness, make_config, tp_of
from worker.core.records import TopicPartition

IN0, IN1 = TopicPartition("in", 0), TopicPartition("in", 1)
RealBackfillRunner = bf.BackfillRunner


class _Stop(BaseException):
    pass


def build(monkeypatch: pytest.MonkeyPatch) -> Harness:
    holder: dict[str, Harness] = {}
    # end snapshot: in[0] holds 3 records; in[1] does not exist yet
    monkeypatch.setattr(bf, "snapshot", lambda cfg, group, ts=None: ({IN0: 0}, {IN0: 3}, {}))

    def factory(cfg, **kw):  # what backfill() builds, on the fakes
        monkeypatch.setattr(wr, "Runner", RealBackfillRunner)
        kw.pop("install_signals", None)
        h = Harness(monkeypatch, cfg, **kw)
        h.send(3)
        h.start()
        c = h.c
        coordinator_assign = c.assign

        def assign(*args):  # the client's assign(list[KTP]) vs the fake's coordinator assign(*tuples)
            if len(args) == 1 and isinstance(args[0], list):
                c.client_assigns.append([(tp_of(k), k.offset) for k in args[0]])
                for k in args[0]:
                    if k.offset >= 0 or k.offset == OFFSET_BEGINNING:
                        c.positions[tp_of(k)] = max(k.offset, 0)
                return None
            return coordinator_assign(*args)

        c.client_assigns = []
        c.assign = assign
        holder["h"] = h

        def run():
            raise _Stop

        h.runner.run = run
        return h.runner

    monkeypatch.setattr(bf, "BackfillRunner", factory)
    monkeypatch.setattr(
        bf.threading,
        "Thread",
        lambda *a, **k: type("T", (), {"start": lambda s: None, "join": lambda s, t=None: None})(),
    )
    with pytest.raises(_Stop):
        bf.backfill(make_config())
    return holder["h"]


def read_to_end(h: Harness) -> None:
    h.c.assign(("in", 0))
    assert h.c.client_assigns[-1] == [(IN0, 0)]
    h.process()
    h.commit()
    h.iterate()
    assert h.committed() == 3 and IN0 in h.runner.reached and IN0 in h.c.paused  # read to its end: paused


def test_a_partition_added_to_the_topic_during_the_backfill_is_left_alone(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A partition the end snapshot does not know made on_assign raise KeyError, which Runner._on_assign
    logged: the chosen start offsets were not applied, and the partitions were not resumed either, so one read
    to its end (paused) before the rebalance stayed paused in the client, and the backfill never completed."""
    h = build(monkeypatch)
    read_to_end(h)
    h.c.revoke(("in", 0))
    h.c.append("in", 0, b'{"id":"live","inputs":1.0}')  # live traffic past the snapshot's end
    h.c.append("in", 1, b'{"id":"new","inputs":1.0}')  # the topic got a partition 1
    h.c.assign(("in", 0), ("in", 1))
    assert h.c.client_assigns[-1][0] == (IN0, 3)  # on from this run's commit
    assert h.c.client_assigns[-1][1][0] == IN1  # assigned too, where the client puts it
    h.iterate(5)
    assert h.runner.loop.backfill_complete()
    # Nothing past the snapshot is processed: only the 3 records of in[0] read before the rebalance.
    assert [r["id"] for r in h.p.results()] == ["in-0-0", "in-0-1", "in-0-2"] and h.committed("in", 1) is None
