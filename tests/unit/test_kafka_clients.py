"""Client helpers: retry_transient bounds every call it makes; config_problem finds what librdkafka refuses
without reaching anything."""

from __future__ import annotations

import socket
from typing import Any

import msgspec
import pytest
from confluent_kafka import KafkaError, KafkaException

from worker.config.settings import from_dict
from worker.kafka.clients import config_problem, retry_transient

BASE_CFG = from_dict({"kafka": {"input_topics": ["in"]}}, environ={})


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


def _listener() -> socket.socket:
    """A local port to count the connections made to it."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    srv.settimeout(0.5)
    return srv


def _accepted(srv: socket.socket) -> int:
    n = 0
    try:
        while True:
            srv.accept()[0].close()
            n += 1
    except OSError:  # timed out: nobody else came
        return n
    finally:
        srv.close()


def test_the_librdkafka_check_connects_to_nothing(capfd: pytest.CaptureFixture[str]) -> None:
    """The clients are made without bootstrap servers (librdkafka connects as soon as one is made) and without
    an OIDC token endpoint (fetched over HTTP when the client is made); nothing logs to the terminal."""
    broker, oidc = _listener(), _listener()
    port = oidc.getsockname()[1]
    security = {"security.protocol": "SASL_SSL", "sasl.mechanisms": "OAUTHBEARER",
                "sasl.oauthbearer.method": "oidc", "sasl.oauthbearer.client.id": "id",
                "sasl.oauthbearer.client.secret": "s",
                "sasl.oauthbearer.token.endpoint.url": f"http://127.0.0.1:{port}/t"}
    cfg = from_dict({"kafka": {"input_topics": ["in"],
                               "bootstrap_servers": f"127.0.0.1:{broker.getsockname()[1]}",
                               "consumer": security, "producer": security}}, environ={})
    assert config_problem(cfg) is None
    assert _accepted(broker) == 0 and _accepted(oidc) == 0
    assert capfd.readouterr().err == ""


@pytest.mark.parametrize("kafka, path, text", [
    ({"consumer": {"sesion.timeout.ms": 10000}}, "$.kafka.consumer.sesion.timeout.ms",
     "No such configuration property"),
    ({"producer": {"linger.ms": "soon"}}, "$.kafka.producer.linger.ms", "Invalid value"),  # an alias
    ({"consumer": {"max.poll.interval.ms": 1000}}, "$.kafka.consumer.max.poll.interval.ms",
     "session.timeout.ms"),
    ({"consumer": {"security.protocol": "SASL_SSL", "sasl.mechanisms": "PLAIN"}}, "$.kafka.consumer",
     "sasl.username and sasl.password must be set"),
])
def test_what_librdkafka_refuses_is_named_by_its_path(kafka: dict[str, Any], path: str, text: str) -> None:
    cfg = msgspec.structs.replace(BASE_CFG, kafka=msgspec.structs.replace(BASE_CFG.kafka, **kafka))
    problem = config_problem(cfg)
    assert problem is not None and problem[0] == path and text in problem[1]


def test_exactly_once_is_checked_with_a_transactional_producer() -> None:
    """librdkafka refuses message.timeout.ms above transaction.timeout.ms only for a transactional
    producer."""
    kafka = msgspec.structs.replace(BASE_CFG.kafka, producer={"message.timeout.ms": 120000})
    assert config_problem(msgspec.structs.replace(BASE_CFG, kafka=kafka)) is None
    eos = msgspec.structs.replace(BASE_CFG, kafka=kafka, delivery=msgspec.structs.replace(BASE_CFG.delivery,
                                                                                          mode="exactly_once"))
    assert config_problem(eos) == ("$.kafka.producer.message.timeout.ms", "librdkafka refuses it: "
                                   "`message.timeout.ms` must be set <= `transaction.timeout.ms`")
