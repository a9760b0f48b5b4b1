"""A broker paused while the worker has results to deliver: its producers hold them, and past
``delivery.producer_stall_s`` the worker replaces them (worker/output/settling.py), purging what they held and
sending it again on new ones, with a longer wait each time while nothing gets delivered. Once the broker
runs again everything is delivered and committed, on the same process, nothing lost.

The replacement is for a librdkafka fault (librdkafka#5430) that a pause past the broker's KRaft session
timeout triggers only by chance: a produce response names no leader for a partition and the producer keeps
that partition's messages queued for good. This pause (8 s) stays under that timeout (9 s), so the producers
are held by the pause alone: the test exercises the replacement itself (a real purge, a real new producer,
the backoff, the re-send) on every run, not the chance."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

from tests.chaos.support import broker_healthy, report, scrape, tally, wait_committed_to_end
from tests.chaos.test_broker_restart import PRODUCER_REPLACED, local_broker
from tests.support.kafka_io import (
    WorkerProcess,
    committed_offsets,
    create_topics,
    produce_values,
    request,
    wait_for,
    worker_config,
)

pytestmark = pytest.mark.chaos

PAUSE_S = 8.0
STALL_S = 2.0


def test_producers_held_by_a_paused_broker_are_replaced_and_nothing_is_lost(kafka, topic_names, tmp_path):
    broker = local_broker(kafka)
    bs, n = kafka.bootstrap, 3000
    create_topics(bs, {topic_names["in"]: 2, topic_names["out"]: 2, topic_names["dlq"]: 1})
    sent = [request(i, prefix="ps", inputs=[float(i)]) for i in range(n)]
    produce_values(bs, topic_names["in"], sent)
    # ~1,500 records/s: the worker is still producing results when the broker pauses.
    cfg = worker_config(bs, topic_names, model={"name": "synthetic", "options": {"a_ms": 20.0, "b_ms": 0.3}},
                        delivery={"producer_stall_s": STALL_S},
                        metrics={"enabled": True, "port": 0, "host": "127.0.0.1"})
    group = cfg["kafka"]["group_id"]
    w = WorkerProcess(cfg, tmp_path, name="producer-stall").start()
    paused_at = during = 0
    try:
        wait_for(lambda: sum(committed_offsets(bs, group, topic_names["in"]).values()) > 0, 90,
                 what="a first commit")
        assert broker.proc is not None
        paused_at = sum(committed_offsets(bs, group, topic_names["in"]).values())
        os.kill(broker.proc.pid, signal.SIGSTOP)
        try:
            time.sleep(PAUSE_S)
            during = w.log().count(PRODUCER_REPLACED)
        finally:
            os.kill(broker.proc.pid, signal.SIGCONT)
        broker_healthy(bs)
        wait_committed_to_end(bs, group, topic_names["in"], 90)
        log = w.log()
        port = int(re.search(r"metrics and health on port (\d+)", log).group(1))  # type: ignore[union-attr]
        counted = scrape(port).get("kiw_producer_replacements_total", 0)
        assert w.stop() == 0, w.log()[-3000:]
    finally:
        w.kill()
        if broker.proc is not None and broker.proc.poll() is None:
            os.kill(broker.proc.pid, signal.SIGCONT)
    t = tally(bs, topic_names["out"], topic_names["dlq"], {k.decode() for k, _ in sent}, n)
    log = w.log()
    report("producer-stall", t, pause_s=PAUSE_S, producer_stall_s=STALL_S, paused_at_committed=paused_at,
           replacements_during_pause=during, producer_replacements=log.count(PRODUCER_REPLACED))
    # Held from the pause on: replaced at 2 s, then 4 s later (nothing delivered between: the wait doubles).
    assert during >= 2, log[-4000:]
    assert counted == log.count(PRODUCER_REPLACED)
    assert t.lost == 0, f"{t.lost} ids without a result"
    assert t.dlq == 0
    assert "giving up delivering" not in log and "Traceback" not in log, log[-3000:]
