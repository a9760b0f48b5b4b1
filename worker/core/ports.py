"""Protocols the runner depends on. Adapters implement them; tests pass fakes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable


class Clock(Protocol):
    def now(self) -> float:
        """Monotonic seconds."""
        ...


class DecodeFailed(Exception):
    """One record's ``decode_batch`` failed on the host threads: that record gets an error result and a dead
    letter at stage ``decode``, as a failing ``decode`` on the loop thread gives; the batch goes on without
    it. ``cause`` is what the handler raised."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"model decode failed: {type(cause).__name__}: {cause}")
        self.cause = cause


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

    Optional, host work off the loop thread: a handler that defines ``decode_batch(inputs) -> items`` (a
    list of validated ``inputs``, one item per input, in order) is decoded on the device's host threads
    (``model.host_threads``) just before ``collate``, never on the loop thread; ``decode`` then serves only
    single calls (warm-up, scripts). Such a handler gives the size for bucketing before decoding with
    ``estimate_size(inputs) -> int`` (exact or estimated; without it every record has size 1). When
    ``decode_batch`` raises, each input of the chunk is decoded alone with ``decode``, and an input that
    fails alone becomes that record's dead letter (stage ``decode``); the rest of the batch goes on.
    ``decode_batch`` may run on several host threads at once, on different chunks of a batch: it must not
    mutate shared state (a Hugging Face fast tokenizer's ``encode_batch`` with fixed padding and truncation
    is safe).

    Handlers need not be thread-safe: ``forward``, ``collate`` and ``split`` each never run on two threads at
    once (recovery re-runs them on other threads). ``collate`` of one batch and ``split`` of another may run
    at the same time: a handler that uses one non-thread-safe object (a tokenizer) in both must lock it
    itself.
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
    softly: on outage implementations answer "unknown" (None, False, empty, 0) instead of raising. The
    ``*_many`` forms are what the runner uses: one round trip per consumed or dispatched batch."""

    def get_cached(self, key: str) -> bytes | None: ...
    def get_cached_many(self, keys: Sequence[str]) -> dict[str, bytes]: ...
    def put_cached(self, key: str, value: bytes) -> None: ...
    def put_cached_many(self, items: Sequence[tuple[str, bytes]]) -> None: ...
    def was_delivered(self, record_id: str) -> bool: ...
    def delivered_many(self, record_ids: Iterable[str]) -> set[str]: ...
    def mark_delivered(self, record_ids: Sequence[str]) -> None: ...
    def incr_attempts(self, attempt_key: str) -> int: ...
    def incr_attempts_many(self, attempt_keys: Sequence[str]) -> list[int]: ...
    def get_attempts_many(self, attempt_keys: Sequence[str]) -> list[int]: ...
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
    def remove_lag(self, topic: str, partition: int) -> None: ...  # a partition no longer assigned


class NullMetrics:
    def records_in(self, lane: str, n: int = 1) -> None: pass
    def records_out(self, lane: str, status: str, n: int = 1) -> None: pass
    def batch(self, lane: str, size: int, fill_ratio: float, queue_wait_s: float,
              infer_s: float) -> None: pass
    def end_to_end(self, lane: str, seconds: float) -> None: pass
    def end_to_end_many(self, lane: str, seconds: list[float]) -> None: pass
    def dlq(self, stage: str, n: int = 1) -> None: pass
    def gauge(self, name: str, value: float, **labels: str) -> None: pass
    def event(self, name: str, n: int = 1, **labels: str) -> None: pass
    def remove_lag(self, topic: str, partition: int) -> None: pass
