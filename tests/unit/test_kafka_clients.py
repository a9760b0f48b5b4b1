"""Client helpers: retry_transient bounds every call it makes."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException

from worker.adapters.kafka_clients import retry_transient


def test_each_call_gets_what_is_left_of_the_timeout() -> None:
    """confluent-kafka calls without a timeout wait forever (e.g. for a partition leader nobody can reach):
    retry_transient's own deadline meant nothing while one such call blocked."""
    seen: list[float] = []

    def committed(parts: list[str], timeout: float) -> list[str]:
        seen.append(timeout)
        if len(seen) < 3:
            raise KafkaException(KafkaError(KafkaError.COORDINATOR_LOAD_IN_PROGRESS))
        return parts

    assert retry_transient(committed, ["p"], timeout=5.0) == ["p"]
    assert len(seen) == 3 and all(0.1 <= t <= 5.0 for t in seen) and seen == sorted(seen, reverse=True)


def test_a_call_that_keeps_timing_out_ends_at_the_deadline() -> None:
    calls: list[float] = []

    def hangs(timeout: float) -> None:
        calls.append(timeout)
        raise KafkaException(KafkaError(KafkaError._TIMED_OUT))

    with pytest.raises(KafkaException):
        retry_transient(hangs, timeout=0.3)
    assert 1 <= len(calls) <= 5
