"""Fuzz target ``dlq``: the headers and value of a record on the dead-letter topic through what ``worker dlq
replay`` does with it (worker.app.dlq.examine, replay_headers), and, for one it would replay, through a real
confluent-kafka producer's produce() (no broker: the message is queued, then purged).

What must hold: examine() never raises; what it quotes is printable text; a replayed dead letter names a
topic the producer takes and carries none of the worker's x-error/x-source/x-attempts headers.
"""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from schemas import DLQ_HEADERS, DeadLetter
from worker.app.dlq import examine, replay_headers, source

_numbers = st.integers(-(2**70), 2**70).map(lambda i: str(i).encode())
_text = st.text(max_size=30).map(str.encode)
_values = (_numbers | _text | st.binary(max_size=30) | st.none()
           | st.sampled_from([b"", b" 7 ", b"1_0", b"\xd9\xa1", b"9" * 5000]))
_topics = (st.sampled_from([b"in", b"in.a-b_c", b"", b"a" * 250, b"bad topic", b"x\x00y", b"\x1b[2J",
                            b"\xff"])
           | st.text(max_size=20).map(str.encode))
_stages = st.sampled_from([b"decode", b"validate", b"size", b"bogus", b"", b"\x1b]0;x\x07"])


@st.composite
def dead_letters(draw: st.DrawFn) -> tuple[list[tuple[str, bytes | None]], bytes | None, str | None]:
    """The worker's headers (each maybe missing, doubled or garbled) among the record's own."""
    good = DeadLetter(error="undecodable json", error_stage="decode", source_topic="in", source_partition=2,
                      source_offset=9).headers()
    headers: list[tuple[str, bytes | None]] = []
    for k, v in good:
        choice = draw(st.integers(0, 5))
        if choice == 0:
            continue  # missing
        if choice == 1:
            v = draw(_topics if k == "x-source-topic" else _stages if k == "x-error-stage" else _values)
        headers.append((k, v))
        if choice == 2:
            headers.append((k, draw(_values)))  # twice: the last one counts
    others = st.tuples(st.sampled_from(["traceparent", "x-priority", "x-error-extra", "x-sourcey", ""])
                       | st.text(max_size=10), _values)
    for h in draw(st.lists(others, max_size=4)):
        headers.insert(draw(st.integers(0, len(headers))), h)
    value = draw(st.none() | st.just(b"") | st.binary(max_size=64))
    stage = draw(st.none() | st.sampled_from(["decode", "validate"]))
    if not headers and draw(st.booleans()):
        return None, value, stage  # type: ignore[return-value]
    return headers, value, stage


_PRODUCER: list[Any] = []


def _producer() -> Any:
    if not _PRODUCER:
        import logging

        from confluent_kafka import Producer

        silent = logging.getLogger("tests.fuzz.dlq")
        silent.addHandler(logging.NullHandler())
        silent.propagate = False
        # A port nothing listens on: messages stay queued until purged.
        _PRODUCER.append(Producer({"bootstrap.servers": "127.0.0.1:9", "logger": silent,
                                   "message.timeout.ms": 600000}))
    return _PRODUCER[0]


def check(headers: list[tuple[str, bytes | None]] | None, value: bytes | None, stage: str | None) -> None:
    seen = examine(headers, value, stage)
    if seen.skip is not None:
        assert seen.skip == "" or seen.skip.isprintable(), seen.skip
        assert seen.letter is not None or seen.skip.startswith(": "), seen.skip
        return
    dl = seen.letter
    assert dl is not None and value
    assert stage is None or dl.error_stage == stage
    assert source(dl).isprintable()
    kept = replay_headers(headers)
    assert not any(k in DLQ_HEADERS or k.startswith(("x-error", "x-source")) for k, _ in kept)
    producer = _producer()
    producer.produce(dl.source_topic, value=value, key=b"k", headers=kept)
    producer.purge()
    producer.poll(0)
