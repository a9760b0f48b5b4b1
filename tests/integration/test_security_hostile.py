"""Hostile records on a real broker, one partition: each gets its dead letter with a clear reason, and the
good requests around them get their results; the partition is committed to its end (nothing stalls it).
The bounds per record (time, memory) are measured in tests/fuzz/test_resource_bounds.py."""

from __future__ import annotations

import time

import msgspec
import pytest

from tests.support.kafka_io import decode, request

pytestmark = pytest.mark.integration

GOOD = [0.5] * 16
HOSTILE: dict[str, tuple[bytes | None, bytes, list[tuple[str, bytes]] | None, str, str]] = {
    # name: (key, value, headers, dead-letter stage, words of its reason)
    "many_items": (b"many", msgspec.json.encode({"id": "many", "inputs": [0] * 400_000}), None, "validate",
                   "length <= 16"),
    "deep": (b"deep", b'{"id": "deep", "inputs": [' + b"0.5," * 15 + b'0.5], "meta": {"m": ' + b"[" * 400_000
             + b"]" * 400_000 + b"}}", None, "decode", "recursion"),
    "headers": (b"headers", b'{"id": "headers", "inputs": 7}', [(f"h{i}", b"v" * 20) for i in range(1000)],
                "validate", "invalid request"),
    "huge_key": (b"k" * 600_000, msgspec.json.encode({"id": "huge-key", "inputs": GOOD}), None, "output",
                 "over message.max.bytes"),
}


def test_hostile_records_get_dead_letters_and_never_stall_the_partition(scenario):
    scenario.topics(1)
    n = 0
    for key, value, headers, _stage, _why in HOSTILE.values():
        scenario.produce([request(i, prefix="good") for i in range(n, n + 5)])
        scenario.produce([(key, value)], headers=headers)
        n += 5
    scenario.produce([request(i, prefix="good") for i in range(n, n + 5)])
    n += 5
    # The worker may write less than it reads: a key that fits the input topic is too big for its result.
    cfg = scenario.config(kafka={"producer": {"message.max.bytes": 500_000}})
    t0 = time.monotonic()
    with scenario.worker(cfg):
        dlq = scenario.read_dlq(want=len(HOSTILE), timeout=120)
        results = scenario.delivered(cfg["kafka"]["group_id"], want=n, timeout=60)
        took = time.monotonic() - t0
    ids = {v["id"] for v in decode(results)}
    assert {f"good-{i}" for i in range(n)} <= ids
    by_stage: dict[str, list[str]] = {}
    for m in dlq:
        h = dict(m.headers())
        by_stage.setdefault(h["x-error-stage"].decode(), []).append(h["x-error"].decode())
    for name, (_k, _v, _h, stage, why) in HOSTILE.items():
        assert any(why in reason for reason in by_stage.get(stage, [])), (name, by_stage)
    assert took < 120, f"{took:.0f} s"
    print(f"[hostile] {len(HOSTILE)} hostile records dead-lettered among {n} good ones in {took:.1f} s")
