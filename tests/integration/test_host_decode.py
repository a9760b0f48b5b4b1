"""Host decode on the real broker: a handler with ``decode_batch`` (the null-device minilm, tokenizing on the
host threads) serves every record once, and a text it cannot decode becomes that record's error result and
dead letter at stage ``decode`` while the rest of its batch is served and every offset is committed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec
import pytest

from tests.bench.null_device import NullDeviceMiniLM
from tests.support.kafka_io import decode

pytestmark = pytest.mark.integration
BAD = "undecodable"


class Picky(NullDeviceMiniLM):
    """Refuses texts that contain ``BAD``, alone and in a batch (as a tokenizer that panics on them)."""

    def decode(self, inputs: Any) -> Any:
        if BAD in inputs.text:
            raise ValueError("this text cannot be tokenized")
        return super().decode(inputs)

    def decode_batch(self, inputs: Sequence[Any]) -> list[Any]:
        if any(BAD in x.text for x in inputs):
            raise ValueError("a text of the batch cannot be tokenized")
        return super().decode_batch(inputs)


def picky(**options: Any) -> Picky:
    return Picky(**options)


def test_host_decode_serves_each_record_once_and_dead_letters_what_it_cannot_decode(scenario):
    n = 2000
    bad = {7, 700, 1001, 1500, 1999}
    scenario.topics(4)
    reqs = [(f"t-{i}".encode(), msgspec.json.encode({"id": f"t-{i}", "inputs": {
        "text": f"{BAD} text {i}" if i in bad else f"Sentence number {i} about Kafka batching."}}))
        for i in range(n)]
    for part in range(4):
        scenario.produce(reqs[part::4], partition=part)
    cfg = scenario.config(model={"name": "tests.integration.test_host_decode:picky",
                                 "warmup": True, "host_threads": 2},
                          batching={"lanes": [{"name": "default", "max_batch_size": 64, "max_wait_ms": 20}]})
    results, _ = scenario.serve(cfg, want=n, timeout=180)
    values = decode(results)
    by_id = {v["id"]: v for v in values}
    assert len(values) == n and set(by_id) == {f"t-{i}" for i in range(n)}
    assert {i for i in range(n) if by_id[f"t-{i}"]["status"] == "error"} == bad
    assert all(len(by_id[f"t-{i}"]["outputs"]) == 384 for i in range(n) if i not in bad)
    assert all(by_id[f"t-{i}"]["error"] == "model decode failed: ValueError: this text cannot be tokenized"
               for i in bad)
    dlq = scenario.read_dlq(want=len(bad), timeout=30)
    assert len(dlq) == len(bad)
    assert {dict(m.headers())["x-error-stage"] for m in dlq} == {b"decode"}
    assert {m.key() for m in dlq} == {f"t-{i}".encode() for i in bad}
