"""The chaos tests' OutputWatcher reads on with a new consumer when its own stops delivering while the topic
has more (tests/chaos/support.py: REOPEN_AFTER_S). Its consumer is paused here to stand for one stuck after a
frozen broker resumed; the reopened one starts where the old one stopped (no id counted twice)."""

from __future__ import annotations

import pytest

import tests.chaos.support as support
from tests.support.kafka_io import create_topics, produce_values, request, wait_for

pytestmark = pytest.mark.chaos


def test_a_stuck_watcher_reads_on_with_a_new_consumer(kafka, topic_names, monkeypatch):
    monkeypatch.setattr(support, "REOPEN_AFTER_S", 2.0)
    bs, out = kafka.bootstrap, topic_names["out"]
    create_topics(bs, {out: 2})
    first = [request(i, prefix="w") for i in range(200)]
    later = [request(i, prefix="w") for i in range(200, 500)]
    expected = {k.decode() for k, _ in first + later}
    produce_values(bs, out, first)
    with support.OutputWatcher(bs, out) as watch:
        wait_for(lambda: watch.seen(expected) == 200, 60, what="the first 200 ids")
        watch._consumer.pause(watch._consumer.assignment())  # stuck: fetches nothing more
        produce_values(bs, out, later)
        wait_for(lambda: watch.seen(expected) == 500, 60, what="the rest, read by a new consumer")
        assert watch.reopened >= 1  # (more than once if a new consumer is slow to fetch its first records)
        assert watch.records == 500  # read on from where the old consumer stopped: nothing twice
        # What a supervised test prints when it runs out of time (nothing committed by this group).
        text = support.where_things_stand(bs, f"g-{topic_names['run']}", out, out, watch)
        assert (
            f"output {out}: ends " in text and "reopened" in text and "committed {0: -1001, 1: -1001}" in text
        )
