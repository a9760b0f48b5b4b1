"""pytest plugin: a real Redis server for integration and chaos tests.

Loaded from tests/conftest.py with ``pytest_plugins = ["tests.conftest_redis"]`` (or ``-p
tests.conftest_redis``).

Fixtures:

- ``redis_url`` (session): the first that works of
  1. ``$REDIS_URL``,
  2. a testcontainers ``RedisContainer`` when a Docker engine answers (checked in well under a second),
  3. a ``LocalRedis`` (Debian's ``redis-server``) on a free port.
  With ``KIW_TEST_SERVERS=local`` (CI) only the third.
  With ``CI=true`` a missing Redis FAILS the tests that need it; elsewhere they are skipped with the reason.
  Tests sharing it must use their own key prefix (the server may be shared; nothing flushes it).
- ``local_redis`` (function): a started ``LocalRedis`` the test owns and may ``stop()``/``start()``
  (same port) or ``pause()``/``resume()``; closed afterwards.
- ``local_redis_factory`` (function): ``factory(**LocalRedis kwargs) -> started LocalRedis`` (e.g.
  ``password=...``, TLS files); every server it made is closed afterwards.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from worker.local.redis_server import LocalRedis, RedisStartError
from worker.store.redis_store import redact_url

LOCAL_ONLY = os.environ.get("KIW_TEST_SERVERS", "").strip().lower() == "local"  # as in tests/conftest.py


def in_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")


def unavailable(reason: str) -> None:
    """Fail in CI (a missing service must not turn into a green run), skip elsewhere."""
    if in_ci():
        pytest.fail(f"{reason} (CI=true: a missing Redis is a failure)", pytrace=False)
    pytest.skip(reason)


def docker_answers(timeout: float = 0.5) -> bool:
    """True when a Docker engine responds to a ping; returns at once when no engine is configured."""
    if not os.environ.get("DOCKER_HOST") and not os.path.exists("/var/run/docker.sock"):
        return False
    try:
        import docker

        client = docker.from_env(timeout=max(1, int(timeout)))
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:  # noqa: BLE001 - any failure means "no usable engine"
        return False


def _start_container() -> tuple[Any, str]:
    from testcontainers.redis import RedisContainer

    container = RedisContainer("redis:7-alpine")
    container.start()
    host = container.get_container_host_ip()
    port = container.get_exposed_port(6379)
    return container, f"redis://{host}:{port}/0"


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    env = os.environ.get("REDIS_URL")
    if env and not LOCAL_ONLY:
        print(f"\n[redis] using server from REDIS_URL={redact_url(env)}")
        yield env
        return
    problems: list[str] = []
    if not LOCAL_ONLY and docker_answers():
        try:
            container, url = _start_container()
        except Exception as e:  # noqa: BLE001 - fall through to the local server
            problems.append(f"testcontainers: {type(e).__name__}: {e}")
        else:
            print(f"\n[redis] testcontainers redis:7-alpine at {url}")
            try:
                yield url
            finally:
                container.stop()
            return
    else:
        problems.append("testcontainers: no Docker engine answers")
    server = LocalRedis()
    try:
        server.start()
    except BaseException as e:
        # also on Ctrl-C or an unexpected error: no process or temp dir outlives a failed start
        server.close()
        if not isinstance(e, RedisStartError):
            raise
        problems.append(f"local redis-server: {e}")
        unavailable("no Redis for integration tests: set REDIS_URL, run Docker, or install redis-server "
                    "(apt-get install redis-server)\n" + "\n".join(problems))
        return
    print(f"\n[redis] local redis-server at {server.url}")
    try:
        yield server.url
    finally:
        server.close()


@pytest.fixture
def local_redis_factory() -> Iterator[Callable[..., LocalRedis]]:
    made: list[LocalRedis] = []

    def factory(**kwargs: Any) -> LocalRedis:
        server = LocalRedis(**kwargs)
        made.append(server)
        try:
            return server.start()
        except BaseException as e:
            server.close()
            if not isinstance(e, RedisStartError):
                raise
            unavailable(f"cannot start a local redis-server: {e}")
            raise  # unreachable: unavailable() raises

    try:
        yield factory
    finally:
        for server in made:
            server.close()


@pytest.fixture
def local_redis(local_redis_factory: Callable[..., LocalRedis]) -> LocalRedis:
    return local_redis_factory()
