"""A corpus of bad inputs mixed into valid traffic: each bad record becomes a dead letter with the right
``x-error-stage`` and/or an ``error``/``expired`` result; every valid record gets an ok result; every
partition's committed offset reaches its end offset (nothing blocks a partition)."""

from __future__ import annotations

import random

import msgspec
import pytest

from tests.chaos.support import report, tally, wait_committed_to_end
from tests.support.kafka_io import (
    WorkerProcess,
    create_topics,
    produce_values,
    request,
    worker_config,
)

pytestmark = pytest.mark.chaos

PARTITIONS = 4
VALID_PER_PARTITION = 750
MAX_INPUT_BYTES = 8192  # room for the nested-too-deep case under the size limit
enc = msgspec.json.encode


def corpus(suffix: str) -> list[tuple[str, bytes | None, str | None, str | None]]:
    """(case, value, expected DLQ stage or None, expected result status or None). Keys are f"{case}-{suffix}"
    and ids (where there is one) the same, so dead letters can be matched by key even without a readable
    id."""
    k = lambda case: f"{case}-{suffix}"  # noqa: E731
    return [
        ("truncated-json", b'{"id": "' + k("truncated-json").encode() + b'", "inputs": [1, 2',
         "decode", None),
        ("invalid-utf8", b'{"id": "' + k("invalid-utf8").encode() + b'", "inputs": "\xff\xfe"}',
         "decode", None),
        ("nan-literal", b'{"id": "' + k("nan-literal").encode() + b'", "inputs": [NaN]}', "decode", None),
        ("tombstone", None, "decode", None),
        ("not-an-object", b"[1, 2, 3]", "validate", None),
        ("id-wrong-type", enc({"id": 42, "inputs": [1]}), "validate", None),
        ("missing-id", enc({"inputs": [1]}), "validate", None),
        ("missing-inputs", enc({"id": k("missing-inputs")}), "validate", "error"),
        ("deadline-wrong-type", enc({"id": k("deadline-wrong-type"), "inputs": [1], "deadline_ms": "soon"}),
         "validate", "error"),
        ("number-out-of-range", b'{"id": "' + k("number-out-of-range").encode() + b'", "inputs": [1e999]}',
         "validate", "error"),
        ("oversize", enc({"id": k("oversize"), "inputs": "x" * (MAX_INPUT_BYTES + 100)}), "size", None),
        ("deadline-past", enc({"id": k("deadline-past"), "inputs": [1], "deadline_ms": 1}),
         "expired", "expired"),
        ("model-raises", enc({"id": k("model-raises"), "inputs": ["poison"]}), "inference", "error"),
        ("unknown-lane", enc({"id": k("unknown-lane"), "inputs": [1], "priority": "nope"}), None, "ok"),
        # Deeper than the decoder's recursion limit (1,000 levels), well under the size limit.
        ("nested-too-deep", b'{"id": "' + k("nested-too-deep").encode() + b'", "inputs": [1], "meta": {"m": '
         + b"[" * 3000 + b"]" * 3000 + b"}}", "decode", None),
    ]


def test_bad_input_corpus(kafka, topic_names, tmp_path):
    bs = kafka.bootstrap
    create_topics(bs, {topic_names["in"]: PARTITIONS, topic_names["out"]: PARTITIONS, topic_names["dlq"]: 1})
    rng = random.Random(7)
    cases: dict[str, tuple[str, str | None, str | None]] = {}  # key -> (case, stage, status)
    valid: set[str] = set()
    for part in range(PARTITIONS):
        items: list[tuple[bytes | None, bytes | None]] = []
        for i in range(VALID_PER_PARTITION):
            key, value = request(part * VALID_PER_PARTITION + i, inputs=[float(i)])
            items.append((key, value))
            valid.add(key.decode())
        for case, value, stage, status in corpus(f"p{part}"):
            key = f"{case}-p{part}"
            cases[key] = (case, stage, status)
            items.insert(rng.randrange(50, len(items) - 50), (key.encode(), value))  # never at the ends
        produce_values(bs, topic_names["in"], items, partition=part)  # type: ignore[arg-type]
    sent = len(valid) + len(cases)

    cfg = worker_config(bs, topic_names, model={"name": "synthetic",
                                                "options": {"a_ms": 1.0, "b_ms": 0.02, "fail_on": "poison"}},
                        delivery={"max_input_bytes": MAX_INPUT_BYTES})
    group = cfg["kafka"]["group_id"]
    w = WorkerProcess(cfg, tmp_path, name="bad-inputs").start()
    try:
        wait_committed_to_end(bs, group, topic_names["in"], 150)
        assert w.proc is not None and w.proc.poll() is None, w.log()[-3000:]
        assert w.stop() == 0, w.log()[-3000:]
    finally:
        w.kill()

    expected_ids = valid | {k for k, (_, _, status) in cases.items() if status is not None}
    t = tally(bs, topic_names["out"], topic_names["dlq"], expected_ids, sent)
    dlq_by_key: dict[str, list[dict[str, str]]] = {}
    for m in t.dead_letters:
        h = {k: v.decode("utf-8", "replace") for k, v in (m.headers() or [])}
        dlq_by_key.setdefault((m.key() or b"").decode(), []).append(h)

    rows = []
    problems = []
    for key, (case, stage, status) in sorted(cases.items(), key=lambda kv: (kv[1][0], kv[0])):
        got_stages = [h.get("x-error-stage") for h in dlq_by_key.get(key, [])]
        got_status = [v["status"] for v in t.by_id.get(key, [])]
        if key.endswith("-p0"):
            rows.append((case, ",".join(s or "?" for s in got_stages) or "-", ",".join(got_status) or "-",
                         (dlq_by_key.get(key) or [{}])[0].get("x-error", "")[:70]))
        if got_stages != ([stage] if stage else []):
            problems.append(f"{key}: DLQ stages {got_stages}, expected {[stage] if stage else []}")
        if got_status != ([status] if status else []):
            problems.append(f"{key}: results {got_status}, expected {[status] if status else []}")
        for h in dlq_by_key.get(key, []):
            part = key.rsplit("-p", 1)[1]
            if h.get("x-source-topic") != topic_names["in"] or h.get("x-source-partition") != part:
                problems.append(f"{key}: dead letter source headers {h}")

    print(f"\n{'case':<22} {'DLQ x-error-stage':<18} {'result':<8} x-error")
    for case, stages, statuses, err in rows:
        print(f"{case:<22} {stages:<18} {statuses:<8} {err}")
    report("bad-inputs", t, bad=len(cases), partitions=PARTITIONS)

    unknown = sorted(set(dlq_by_key) - set(cases))
    assert not unknown, f"dead letters for records that were not bad: {unknown[:5]}"
    assert not problems, "\n".join(problems)
    assert t.lost == 0
    ok_valid = [vs for i, vs in t.by_id.items() if i in valid]
    assert len(ok_valid) == len(valid) and all(len(vs) == 1 and vs[0]["status"] == "ok" for vs in ok_valid)
    lane = t.by_id["unknown-lane-p0"][0]["lane"]
    assert lane == "default", f"unknown lane served by {lane!r}"
    assert t.dlq == sum(1 for _, stage, _ in cases.values() if stage)
