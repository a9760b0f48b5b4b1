"""Protocols the runner depends on. Adapters implement them; tests pass fakes."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds."""
        ...


@runtime_checkable
class Model(Protocol):
    """A model handler: the five stages the inference stage calls, in this order.

    ``input_type`` / ``output_type`` are msgspec Structs (or any msgspec-supported type): requests decode
    and validate straight into ``Request[input_type]``, and their JSON Schema is exported into ``schemas/``.

    - ``setup(device)``: load weights onto ``device`` ("cpu", "cuda:0", ...). Called once, before traffic.
    - ``decode(inputs) -> item``: per record, on the loop thread (never the device thread): tokenize, etc.
    - ``collate(items) -> batch``: build the device batch (tensors); may pad.
    - ``forward(batch) -> output``: the device work. Runs under ``torch.inference_mode``.
    - ``split(output, n) -> list``: one JSON-encodable output per input, in order. The runner checks ``n``.

    Optional: ``size_of(item) -> int`` (length used for bucketing), ``name`` and ``version`` (go in the
    result and in the cache key).
    """

    # Read-only properties, so a handler may declare them as class attributes or instance attributes.
    @property
    def name(self) -> str: ...
    @property
    def version(self) -> str: ...
    @property
    def input_type(self) -> Any: ...
    @property
    def output_type(self) -> Any: ...

    def setup(self, device: str) -> None: ...
    def decode(self, inputs: Any) -> Any: ...
    def collate(self, items: Sequence[Any]) -> Any: ...
    def forward(self, batch: Any) -> Any: ...
    def split(self, output: Any, n: int) -> list[Any]: ...


class Store(Protocol):
    """Optional state shared across restarts and replicas (Redis, or in memory). Every method may fail
    softly: implementations return None/False on outage instead of raising."""

    def get_cached(self, key: str) -> bytes | None: ...
    def put_cached(self, key: str, value: bytes) -> None: ...
    def was_delivered(self, record_id: str) -> bool: ...
    def mark_delivered(self, record_ids: Sequence[str]) -> None: ...
    def incr_attempts(self, attempt_key: str) -> int: ...
    def clear_attempts(self, attempt_keys: Sequence[str]) -> None: ...


class Metrics(Protocol):
    """Observation hooks; the Prometheus adapter implements them, NullMetrics ignores them."""

    def records_in(self, lane: str, n: int = 1) -> None: ...
    def records_out(self, lane: str, status: str, n: int = 1) -> None: ...
    def batch(self, lane: str, size: int, fill_ratio: float, queue_wait_s: float, infer_s: float) -> None: ...
    def end_to_end(self, lane: str, seconds: float) -> None: ...
    def end_to_end_many(self, lane: str, seconds: list[float]) -> None: ...
    def dlq(self, stage: str, n: int = 1) -> None: ...
    def gauge(self, name: str, value: float, **labels: str) -> None: ...
    def event(self, name: str, n: int = 1, **labels: str) -> None: ...


class NullMetrics:
    def records_in(self, lane: str, n: int = 1) -> None: pass
    def records_out(self, lane: str, status: str, n: int = 1) -> None: pass
    def batch(self, lane: str, size: int, fill_ratio: float, queue_wait_s: float, infer_s: float) -> None: pass
    def end_to_end(self, lane: str, seconds: float) -> None: pass
    def end_to_end_many(self, lane: str, seconds: list[float]) -> None: pass
    def dlq(self, stage: str, n: int = 1) -> None: pass
    def gauge(self, name: str, value: float, **labels: str) -> None: pass
    def event(self, name: str, n: int = 1, **labels: str) -> None: pass
