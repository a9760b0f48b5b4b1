"""Hostile records within delivery.max_input_bytes: each gets its outcome (a dead letter with a clear reason,
or a result) through the real intake and Emitter, within bounded time and memory. The worst case of each is
measured (time, and peak Python memory with tracemalloc) and printed; the bounds asserted are generous, well
above what is measured, so that a slow machine passes and a blow-up (quadratic time, memory that grows with
more than the record) does not. The same records on a real broker: tests/integration/test_security_hostile.py.
"""

from __future__ import annotations

import time
import tracemalloc
from typing import Any

import msgspec
import pytest

from tests.fuzz import target_intake

MAX_INPUT = 4 * 1024 * 1024  # delivery.max_input_bytes for these: big enough for a million items
MESSAGE_MAX = 1_000_000  # librdkafka's default message.max.bytes
TIME_BOUND_S = 10.0
MEMORY_PER_BYTE = 64  # peak Python memory at most this many times the record's size, plus a constant
MEMORY_BASE = 32 * 1024 * 1024


def _json(body: dict[str, Any]) -> bytes:
    return msgspec.json.encode(body)


def _msgpack(body: dict[str, Any]) -> bytes:
    return msgspec.msgpack.encode(body)


def _deep_json(depth: int, field: str = "inputs") -> bytes:
    return b'{"id": "deep", "' + field.encode() + b'": ' + b"[" * depth + b"0" + b"]" * depth + b"}"


ONE_M = 1_000_000
GOOD = [0.5] * 16
# name: (format, value, key, headers, the outcome: dead-letter stage (None: a result) and words of the reason)
CASES: dict[str, tuple[str, bytes, bytes | None, list[tuple[str, bytes]], str | None, str]] = {
    "million_items_json": ("json", _json({"id": "m", "inputs": [0] * ONE_M}), None, [], "validate", "length"),
    "million_items_msgpack": ("msgpack", _msgpack({"id": "m", "inputs": [0] * ONE_M}), None, [], "validate",
                              "length"),
    "million_items_in_meta": ("json", _json({"id": "m", "inputs": GOOD, "meta": {"a": [0] * ONE_M}}), None,
                              [], "output", "over message.max.bytes"),
    "million_keys_in_meta": ("msgpack", _msgpack({"id": "m", "inputs": GOOD,
                                                  "meta": {str(i): 0 for i in range(300_000)}}), None, [],
                             "output", "over message.max.bytes"),
    # Validation stops at the first element that is not a float: the depth is never reached.
    "deep_nesting_inputs": ("json", _deep_json(1_000_000), None, [], "validate", "Expected `float`"),
    # Under meta (any value) the decoder goes down until its depth limit.
    "deep_nesting_meta": ("json", b'{"id": "d", "inputs": [' + b"0.5," * 15 + b'0.5], "meta": {"m": '
                          + b"[" * 1_000_000 + b"]" * 1_000_000 + b"}}", None, [], "decode",
                          "undecodable json"),
    "deep_nesting_msgpack": ("msgpack", _msgpack({"id": "d", "inputs": GOOD}).replace(b"\x82", b"\x83", 1)
                             + b"\xa4meta\x81\xa1m" + b"\x91" * 1_000_000 + b"\x00", None, [], "decode",
                             "undecodable msgpack"),
    "thousand_headers_valid": ("json", _json({"id": "h", "inputs": GOOD}), None,
                               [("x-priority", b"nope-%d" % i) for i in range(1000)], None, ""),
    "thousand_headers_invalid": ("json", _json({"id": "h", "inputs": "x"}), None,
                                 [(f"h{i}", b"v" * 50) for i in range(1000)], "validate", "invalid request"),
    "huge_key_valid": ("json", _json({"id": "k", "inputs": GOOD}), b"k" * 999_900, [], "output",
                       "over message.max.bytes"),
    "huge_key_invalid": ("json", b"{", b"k" * 999_000, [], "decode", "undecodable json"),
    "huge_id": ("json", _json({"id": "i" * 900_000, "inputs": GOOD}), None, [], "validate", "length"),
    "ext_types_in_inputs": ("msgpack", _msgpack({"id": "e",
                                                 "inputs": [msgspec.msgpack.Ext(1, b"x" * 60_000)] * 16}),
                            None, [], "validate", "invalid request"),
    "ext_types_in_meta": ("msgpack", _msgpack({"id": "e", "inputs": GOOD,
                                               "meta": {"e": [msgspec.msgpack.Ext(7, b"y" * 100)] * 5000}}),
                          None, [], None, ""),
    "oversize": ("json", b" " * (MAX_INPUT + 1), None, [], "size", "max_input_bytes"),
}
# A timestamp extension (type -1) of a length msgpack does not define, where meta is read.
CASES["bad_timestamp_ext"] = ("msgpack", _msgpack({"id": "t", "inputs": GOOD}).replace(b"\x82", b"\x83", 1)
                              + b"\xa4meta\x81\xa1t\xc7\x03\xff\x00\x00\x00", None, [], "validate",
                              "timestamp")


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_record_is_bounded(name: str) -> None:
    fmt, value, key, headers, stage, reason = CASES[name]
    assert len(value) <= MAX_INPUT or stage == "size"
    target_intake.intake(fmt, MAX_INPUT)  # the model and intake are made outside the measurement

    def once() -> Any:
        return target_intake.check(fmt, value, key, headers, "in", max_input_bytes=MAX_INPUT,
                                   message_max=MESSAGE_MAX, bound_s=TIME_BOUND_S)

    t0 = time.perf_counter()
    sent = once()  # timed without tracemalloc, which slows every allocation down several times
    took = time.perf_counter() - t0
    tracemalloc.start()
    try:
        once()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    print(f"{name}: {len(value)} bytes, {took * 1000:.0f} ms, peak {peak / 2**20:.1f} MiB, "
          f"outcome {sent.status}/{sent.dlq_stage}: {(sent.error or '')[:90]}")
    assert sent.dlq_stage == stage, (sent.dlq_stage, sent.error)
    assert reason in (sent.error or ""), sent.error
    assert took < TIME_BOUND_S
    assert peak < MEMORY_BASE + MEMORY_PER_BYTE * len(value), f"peak {peak / 2**20:.0f} MiB"
