"""Shared fixtures. Kafka and Redis resolve in this order: an address from the environment
(KAFKA_BOOTSTRAP_SERVERS / REDIS_URL) -> testcontainers when a Docker engine answers -> a local process
(worker/local). With CI=true a test that needs one and cannot get it FAILS; it never skips."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from tests.support import props

pytest_plugins = ["tests.conftest_redis", "tests.conftest_secure"]
HYPOTHESIS_PROFILE = props.load()  # before any test module builds its @settings

IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")
# KIW_TEST_SERVERS=local (set by .ci/run): always the local broker and redis-server processes, never one named
# by the environment or a Docker engine that happens to answer (the chaos tests restart the local ones).
LOCAL_ONLY = os.environ.get("KIW_TEST_SERVERS", "").strip().lower() == "local"


def unavailable(what: str, why: str) -> None:
    if IN_CI:
        pytest.fail(f"{what} unavailable in CI (CI=true never skips): {why}", pytrace=False)
    pytest.skip(f"{what} unavailable: {why}")


def docker_engine_answers() -> bool:
    """A quick ping of the Docker engine API; False in well under a second when there is none."""
    import socket

    host = os.environ.get("DOCKER_HOST", "unix:///var/run/docker.sock")
    if not host.startswith("unix://"):
        return False
    path = host[len("unix://"):]
    if not os.path.exists(path):
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(0.5)
            s.connect(path)
            s.sendall(b"GET /_ping HTTP/1.0\r\n\r\n")
            return b"200 OK" in s.recv(64)
    except OSError:
        return False


class KafkaHandle:
    """What the tests get: a bootstrap address, and (for the local process) the broker itself, which chaos
    tests can stop and start again on the same ports and data directory."""

    def __init__(self, bootstrap: str, version: str, broker: object | None = None) -> None:
        self.bootstrap = bootstrap
        self.version = version
        self.broker = broker


@pytest.fixture(scope="session")
def kafka() -> Iterator[KafkaHandle]:
    env = os.environ.get("KAFKA_BOOTSTRAP_SERVERS")
    if env and not LOCAL_ONLY:
        print(f"\n[kafka] using broker from KAFKA_BOOTSTRAP_SERVERS={env}")
        yield KafkaHandle(env, "external (version not reported by the admin API)")
        return
    if not LOCAL_ONLY and docker_engine_answers():
        try:
            from testcontainers.kafka import KafkaContainer

            with KafkaContainer("apache/kafka:4.1.1").with_kraft() as kc:
                bs = kc.get_bootstrap_server()
                print(f"\n[kafka] testcontainers Apache Kafka 4.1.1 at {bs}")
                yield KafkaHandle(bs, "4.1.1 (container)")
                return
        except Exception as e:  # fall through to the local process
            print(f"\n[kafka] testcontainers failed ({e}); starting a local broker")
    from worker.local.kafka_broker import LocalKafka

    broker = LocalKafka()
    try:
        broker.start()
    except BaseException as e:
        # start() cleans up after itself; close() again so that nothing (process, temp dir) can outlive a
        # failed or interrupted (Ctrl-C) start whatever start() did.
        broker.close()
        if not isinstance(e, Exception):
            raise
        unavailable("Kafka broker", str(e))
        return
    print(f"\n[kafka] local Apache Kafka {broker.version} (KRaft) at {broker.bootstrap}")
    try:
        yield KafkaHandle(broker.bootstrap, broker.version, broker)
    finally:
        broker.close()


@pytest.fixture
def topic_names() -> dict[str, str]:
    run = uuid.uuid4().hex[:8]
    return {"in": f"t-in-{run}", "out": f"t-out-{run}", "dlq": f"t-dlq-{run}", "run": run}


def pytest_report_header(config: pytest.Config) -> list[str]:
    return [f"CI={'true' if IN_CI else 'false'} (true: missing Kafka/Redis fail the run, never skip)",
            f"hypothesis profile: {HYPOTHESIS_PROFILE} ({props.PROFILE_ENV}; "
            f"{props.SCALE[HYPOTHESIS_PROFILE]}x each property test's examples)"]
