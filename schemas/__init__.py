"""The wire contract (ARCHITECTURE section 6): request, result and dead-letter structs.

Wire structs are tolerant: unknown fields are ignored and new fields get defaults, so producers and
consumers can be upgraded independently. ``python -m schemas.export`` writes the JSON Schema files next
to this module; tests/unit/test_schemas.py fails when they are stale.
"""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar

import msgspec

T = TypeVar("T")

RequestId = Annotated[str, msgspec.Meta(min_length=1, max_length=512,
                                        description="Caller's id, echoed in the result")]
# Bounded so that the worker's float arithmetic on it cannot overflow: a 309-digit deadline decoded as a
# Python int and raised OverflowError in the loop, on every restart, for whichever worker took the partition.
DeadlineMs = Annotated[int, msgspec.Meta(ge=-(2**53), le=2**53,
                                         description="Absolute deadline, Unix epoch ms")]


class Request(msgspec.Struct, Generic[T], kw_only=True, frozen=True):
    """One inference request, the value of a record on an input topic."""

    id: RequestId
    inputs: T
    priority: str | None = None  # lane name; overrides the lane chosen by topic
    # Absolute deadline, Unix epoch milliseconds. Past it the record is not sent to the model: it gets an
    # ``expired`` result and a dead letter.
    deadline_ms: DeadlineMs | None = None
    meta: dict[str, Any] | None = None  # opaque, echoed in the result


class Source(msgspec.Struct, kw_only=True, frozen=True):
    topic: str
    partition: int
    offset: int


class Timings(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """Milliseconds. ``queue_ms``: receive -> batch dispatched; ``inference_ms``: the batch's device time;
    ``total_ms``: receive -> result encoded; ``e2e_ms``: the request's Kafka timestamp -> result encoded."""

    queue_ms: float = 0.0
    inference_ms: float = 0.0
    total_ms: float = 0.0
    e2e_ms: float | None = None


Status = Literal["ok", "error", "expired"]


class Float32Tensor(msgspec.Struct, kw_only=True, frozen=True):
    """A numeric output packed by ``delivery.outputs_encoding: float32``: ``data`` holds the values as
    little-endian float32, row-major (C order), ``shape`` their dimensions. In msgpack ``data`` is a bin, in
    JSON a base64 string. Decode: ``numpy.frombuffer(data, "<f4").reshape(shape)``."""

    dtype: Literal["float32"] = "float32"
    shape: list[int]
    data: bytes


_TENSOR_SCHEMA = {
    "type": "object", "title": "Float32Tensor", "required": ["shape", "data"],
    "description": Float32Tensor.__doc__,
    "properties": {
        "dtype": {"const": "float32"},
        "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
        "data": {"type": "string", "contentEncoding": "base64",
                 "description": "little-endian float32 values, row-major; a bin in msgpack"},
    },
}
Outputs = Annotated[Any, msgspec.Meta(
    description="What the model returned for the request. With delivery.outputs_encoding: float32 a numeric "
                "output (a list of floats, nested lists of floats of one shape, an array) is a "
                "Float32Tensor; every other output (a dict of labels, strings, ints, bools, mixed lists) is "
                "as returned.",
    extra_json_schema={"anyOf": [_TENSOR_SCHEMA, {}]})]


class Result(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """The value of a record on the output topic; its key is the request's key."""

    id: str
    status: Status
    model: str
    lane: str
    batch_size: int
    source: Source
    timings: Timings
    outputs: Outputs = None
    error: str | None = None
    model_version: str | None = None
    meta: dict[str, Any] | None = None
    cached: bool = False


# Dead letters keep the original key, value and headers untouched and add these headers (values UTF-8).
H_ERROR = "x-error"
H_ERROR_STAGE = "x-error-stage"
H_SOURCE_TOPIC = "x-source-topic"
H_SOURCE_PARTITION = "x-source-partition"
H_SOURCE_OFFSET = "x-source-offset"
H_ATTEMPTS = "x-attempts"
H_PRIORITY = "x-priority"
DLQ_HEADERS = (H_ERROR, H_ERROR_STAGE, H_SOURCE_TOPIC, H_SOURCE_PARTITION, H_SOURCE_OFFSET, H_ATTEMPTS)

ErrorStage = Literal["size", "decode", "validate", "route", "expired", "inference", "output", "quarantine"]


class DeadLetter(msgspec.Struct, kw_only=True, frozen=True):
    """The ``x-*`` headers of a dead-letter record, as a struct (the record's value is the original bytes)."""

    error: str
    error_stage: ErrorStage
    source_topic: str
    source_partition: int
    source_offset: int
    attempts: int = 1

    def headers(self) -> list[tuple[str, bytes]]:
        return [
            (H_ERROR, self.error.encode()),
            (H_ERROR_STAGE, self.error_stage.encode()),
            (H_SOURCE_TOPIC, self.source_topic.encode()),
            (H_SOURCE_PARTITION, str(self.source_partition).encode()),
            (H_SOURCE_OFFSET, str(self.source_offset).encode()),
            (H_ATTEMPTS, str(self.attempts).encode()),
        ]

    @classmethod
    def from_headers(cls, headers: list[tuple[str, bytes]] | None) -> DeadLetter:
        h = {k: (v or b"").decode("utf-8", "replace") for k, v in (headers or [])}
        missing = [k for k in DLQ_HEADERS[:5] if k not in h]
        if missing:
            raise ValueError(f"not a dead letter: missing headers {missing}")
        return cls(
            error=h[H_ERROR],
            error_stage=h[H_ERROR_STAGE],  # type: ignore[arg-type]
            source_topic=h[H_SOURCE_TOPIC],
            source_partition=int(h[H_SOURCE_PARTITION]),
            source_offset=int(h[H_SOURCE_OFFSET]),
            attempts=int(h.get(H_ATTEMPTS, "1")),
        )


__all__ = [
    "DLQ_HEADERS", "DeadLetter", "ErrorStage", "Float32Tensor", "H_ATTEMPTS", "H_ERROR", "H_ERROR_STAGE",
    "H_PRIORITY",
    "H_SOURCE_OFFSET", "H_SOURCE_PARTITION", "H_SOURCE_TOPIC", "Request", "Result", "Source", "Status",
    "Timings",
]
