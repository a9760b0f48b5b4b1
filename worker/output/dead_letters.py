"""A record's dead letter, and the size librdkafka gives a message, so that what is produced always fits.

librdkafka refuses a message when its largest possible size on the wire is over ``message.max.bytes``
(``rd_kafka_msg_max_wire_size``): key + value + headers + ``RECORD_OVERHEAD`` (varints at their widest).
"""

from __future__ import annotations

from schemas import DeadLetter
from worker.core.records import Record

RECORD_OVERHEAD = 36
ERROR_IN_RESULT = 200  # characters of the reason an error result keeps when the whole one makes it too big

Headers = list[tuple[str, bytes]]


def _varint_len(n: int) -> int:
    """Bytes of a length as a zigzag varint (how a record writes its header name and value lengths)."""
    v, size = n << 1, 1
    while v >= 0x80:
        v >>= 7
        size += 1
    return size


def message_size(key: bytes | None, value: bytes | None, headers: Headers | None = None) -> int:
    """What librdkafka compares with message.max.bytes: key + value + each header's name and value with
    their varint lengths + the record overhead."""
    size = RECORD_OVERHEAD + len(key or b"") + len(value or b"")
    for k, v in headers or ():
        name = len(k.encode())
        size += _varint_len(name) + name + _varint_len(len(v or b"")) + len(v or b"")
    return size


def dead_letter(rec: Record, stage: str, error: str) -> DeadLetter:
    return DeadLetter(error=error[:4000], error_stage=stage,  # type: ignore[arg-type]
                      source_topic=rec.tp.topic, source_partition=rec.tp.partition,
                      source_offset=rec.offset, attempts=max(rec.attempts, 1))


def dead_letter_message(rec: Record, stage: str, reason: str, limit: int, refused: str | None = None
                        ) -> tuple[bytes | None, bytes | None, Headers]:
    """(key, value, headers) of the record's dead letter: its original bytes, key and headers (less stale
    ``x-*`` ones) and the reason. When the input topic took a record bigger than ``limit``
    (message.max.bytes) the original bytes are dropped; should it still not fit, the reason is cut to
    ``ERROR_IN_RESULT`` characters, then the bigger of its headers and key is dropped, then the other, and the
    reason says what went. What is left (the ``x-*`` headers, a topic name of at most 249 characters) fits in
    librdkafka's smallest message.max.bytes, 1000; anything bigger would make produce() raise, and the same
    record stop the worker at every restart. ``refused``: the broker refused the whole dead letter (its
    reason): the original bytes are dropped whatever their size."""
    kept = [(k, v) for k, v in rec.headers if not k.startswith("x-error") and not k.startswith("x-source")
            and k != "x-attempts"]
    key = rec.key
    headers = kept + dead_letter(rec, stage, reason).headers()
    if refused is None and message_size(key, rec.value, headers) <= limit:
        return key, rec.value, headers
    dropped = f"original value of {len(rec.value or b'')} bytes"
    why = refused or f"over message.max.bytes={limit}"

    def letter() -> Headers:
        return kept + dead_letter(rec, stage, f"{dropped} dropped ({why}): {reason}").headers()

    headers = letter()
    if message_size(key, b"", headers) > limit and len(reason) > ERROR_IN_RESULT:
        reason = reason[:ERROR_IN_RESULT] + " ... (cut)"
        headers = letter()
    kept_size = message_size(None, None, kept) - RECORD_OVERHEAD
    for part in sorted(("headers", "key"), key=lambda p: kept_size if p == "headers" else len(key or b""),
                       reverse=True):  # the bigger one first: the other may then stay
        if message_size(key, b"", headers) <= limit:
            break
        if part == "headers" and kept:
            dropped += f", its headers ({kept_size} bytes)"
            kept = []
        elif part == "key" and key:
            dropped += f", its key ({len(key)} bytes)"
            key = None
        headers = letter()
    return key, b"", headers
