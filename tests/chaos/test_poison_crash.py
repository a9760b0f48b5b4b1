"""A record that kills the process (synthetic ``crash_on``: ``os._exit(137)`` in forward). With Redis holding
the attempt counters across restarts and ``delivery.max_attempts: 2``, a supervisor restarts the worker each
time it dies; after at most max_attempts + 1 crashes the record is quarantined to the DLQ, every other record
gets an ok result, and the last worker stays up with every partition committed to its end."""

from __future__ import annotations

import time
import uuid

import msgspec
import pytest
import redis

from tests.chaos.support import (
    OutputWatcher,
    report,
    supervise,
    tally,
    wait_committed_to_end,
    where_things_stand,
)
from tests.support.kafka_io import (
    WorkerProcess,
    create_topics,
    produce_values,
    read_all,
    request,
    worker_config,
)

pytestmark = pytest.mark.chaos

PER_PARTITION = 1500
MAX_ATTEMPTS = 2
FAST_GROUP = {"session.timeout.ms": 6000, "heartbeat.interval.ms": 500}


def test_crashing_record_is_quarantined_after_max_attempts(kafka, redis_url, topic_names, tmp_path):
    bs = kafka.bootstrap
    create_topics(bs, {topic_names["in"]: 2, topic_names["out"]: 2, topic_names["dlq"]: 1})
    valid: set[str] = set()
    for part in range(2):
        items = [request(part * PER_PARTITION + i, inputs=[float(i)]) for i in range(PER_PARTITION)]
        valid |= {k.decode() for k, _ in items}
        if part == 0:  # the killer sits in the middle of partition 0
            items.insert(PER_PARTITION // 2, (b"killer", msgspec.json.encode({"id": "killer",
                                                                              "inputs": "boom"})))
        produce_values(bs, topic_names["in"], items, partition=part)
    sent = len(valid) + 1

    prefix = f"kiw-chaos:{uuid.uuid4().hex[:8]}:"
    cfg = worker_config(bs, topic_names,
                        model={"name": "synthetic", "options": {"a_ms": 2.0, "b_ms": 0.05,
                                                                "crash_on": "boom"}},
                        kafka={"consumer": FAST_GROUP, "commit_interval_ms": 300},
                        delivery={"max_attempts": MAX_ATTEMPTS},
                        redis={"url": redis_url, "key_prefix": prefix, "timeout_ms": 500})
    group = cfg["kafka"]["group_id"]

    with OutputWatcher(bs, topic_names["out"]) as watch:
        sup = supervise(lambda i: WorkerProcess(cfg, tmp_path, name=f"crashloop-{i}"),
                        lambda: watch.seen(valid), len(valid), deadline_s=170, restart_exits=True,
                        max_exits=MAX_ATTEMPTS + 2, diagnose=lambda: where_things_stand(
                            bs, cfg["kafka"]["group_id"], topic_names["in"], topic_names["out"], watch))
    last = sup.current
    raw = redis.Redis.from_url(redis_url)
    try:
        crashes = [i.returncode for i in sup.exits]
        quarantined = read_all(bs, topic_names["dlq"], want=1, timeout=60)
        wait_committed_to_end(bs, group, topic_names["in"], 60)
        time.sleep(2)
        assert last.proc is not None and last.proc.poll() is None, f"final worker died:\n{last.log()[-3000:]}"
        assert last.stop() == 0, last.log()[-3000:]
        leftover_counters = raw.keys(f"{prefix}attempts:*")
    finally:
        last.kill()
        stale = raw.keys(f"{prefix}*")
        if stale:
            raw.delete(*stale)
        raw.close()

    t = tally(bs, topic_names["out"], topic_names["dlq"], valid, sent)
    report("poison-crash", t, crashes=len(crashes), max_attempts=MAX_ATTEMPTS, seconds=round(sup.elapsed_s))
    assert 1 <= len(crashes) <= MAX_ATTEMPTS + 1 and all(rc == 137 for rc in crashes), crashes
    stages = [(m.key(), dict(m.headers() or []).get("x-error-stage")) for m in t.dead_letters]
    assert stages == [(b"killer", b"quarantine")], f"dead letters: {stages[:10]} ({len(stages)} in all)"
    assert quarantined[0].value() == msgspec.json.encode({"id": "killer", "inputs": "boom"})  # original bytes
    h = dict(quarantined[0].headers() or [])
    assert int(h["x-attempts"]) >= MAX_ATTEMPTS and h["x-source-partition"] == b"0", h
    killer = [v["status"] for v in t.by_id.get("killer", [])]
    assert killer == ["error"], f"the quarantined requester's results: {killer}"
    assert t.lost == 0, f"{t.lost} valid ids without a result"
    not_ok = sorted(i for i, vs in t.by_id.items() if i in valid and any(v["status"] != "ok" for v in vs))
    assert not not_ok, f"{len(not_ok)} valid records did not get (only) ok results, e.g. {not_ok[:5]}"
    # Every other record's counter is cleared once delivered; the quarantined one keeps its count until
    # attempts_ttl_s (cleared before its offset is committed, a second poison record could make the two take
    # turns crashing the worker).
    killer_key = f"{prefix}attempts:{group}:{topic_names['in']}:0:{PER_PARTITION // 2}".encode()
    assert leftover_counters == [killer_key], f"attempt counters left after delivery: {leftover_counters[:5]}"
