from __future__ import annotations

import pytest

from worker.config.settings import RedisConfig
from worker.store.from_config import make_store
from worker.store.memory_store import MemoryStore
from worker.store.redis_store import CircuitBreaker, RedisStore, redact_url


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def now(self) -> float:
        return self.t


def breaker(failures: int = 3, reset_s: float = 5.0) -> tuple[CircuitBreaker, Clock, list[str]]:
    clock = Clock()
    changes: list[str] = []
    return CircuitBreaker(failures, reset_s, clock, on_change=changes.append), clock, changes


def test_opens_after_n_consecutive_failures_only() -> None:
    b, _, changes = breaker(failures=3)
    b.record_failure()
    b.record_failure()
    b.record_success()  # resets the streak
    b.record_failure()
    b.record_failure()
    assert b.state == "closed" and b.allow()
    b.record_failure()
    assert b.state == "open" and not b.allow()
    assert changes == ["open"]


def test_half_open_after_reset_then_closes_on_success() -> None:
    b, clock, changes = breaker(failures=1, reset_s=5)
    b.record_failure()
    clock.t = 4.9
    assert not b.allow() and b.state == "open"
    clock.t = 5.0
    assert b.state == "half_open"
    assert b.allow()  # the probe
    assert not b.allow()  # only one probe at a time
    b.record_success()
    assert b.state == "closed" and b.allow()
    assert changes == ["open", "half_open", "closed"]


def test_failed_probe_reopens_for_another_reset_period() -> None:
    b, clock, changes = breaker(failures=2, reset_s=5)
    b.record_failure()
    b.record_failure()
    clock.t = 6
    assert b.allow()
    b.record_failure()
    assert b.state == "open"
    clock.t = 10.9
    assert not b.allow()
    clock.t = 11
    assert b.allow()
    assert changes == ["open", "half_open", "open", "half_open"]


def test_lost_probe_is_replaced_after_reset_period() -> None:
    b, clock, _ = breaker(failures=1, reset_s=5)
    b.record_failure()
    clock.t = 5
    assert b.allow()
    clock.t = 9.9
    assert not b.allow()
    clock.t = 10
    assert b.allow()


def test_late_success_does_not_close_an_open_breaker() -> None:
    b, _, _ = breaker(failures=1)
    b.record_failure()
    b.record_success()
    assert b.state == "open"


def test_invalid_settings() -> None:
    with pytest.raises(ValueError, match="failures must be >= 1"):
        CircuitBreaker(0, 1)
    with pytest.raises(ValueError, match="reset_s must be > 0"):
        CircuitBreaker(1, 0)


# -- RedisStore without a server: construction is lazy and secrets stay hidden -----------------------------

def test_redis_store_is_lazy_and_hides_the_password() -> None:
    cfg = RedisConfig(url="redis://:s3cret-url@10.255.255.1:6379/0", password="s3cret-cfg")
    s = RedisStore(cfg)
    assert s._client_obj is None  # no client, so no connection attempt, in __init__
    for text in (repr(s), s.url):
        assert "s3cret" not in text
    assert s.url == "redis://:***@10.255.255.1:6379/0"


def test_tls_settings_reach_the_client() -> None:
    s = RedisStore(RedisConfig(url="redis://cache:6380/1", tls=True, tls_ca_file="/etc/ca.pem",
                               timeout_ms=80))
    assert s.url.startswith("rediss://")
    kw = s._client().connection_pool.connection_kwargs  # made without connecting
    assert kw["ssl_ca_certs"] == "/etc/ca.pem"
    assert kw["socket_timeout"] == pytest.approx(0.08) and kw["socket_connect_timeout"] == pytest.approx(0.08)


def test_config_errors_are_actionable() -> None:
    with pytest.raises(ValueError, match="redis.url is required"):
        RedisStore(RedisConfig())
    with pytest.raises(ValueError, match="redis://, rediss:// or unix://"):
        RedisStore(RedisConfig(url="http://x"))
    with pytest.raises(ValueError, match="tls_ca_file is set but TLS is off"):
        RedisStore(RedisConfig(url="redis://x", tls_ca_file="/ca.pem"))


def test_make_store_picks_by_url() -> None:
    assert isinstance(make_store(RedisConfig(url="redis://127.0.0.1:1/0")), RedisStore)
    assert isinstance(make_store(RedisConfig()), MemoryStore)


def test_redact_url() -> None:
    assert redact_url("rediss://user:pw@h:1/0") == "rediss://user:***@h:1/0"
    assert redact_url("redis://h:1/0") == "redis://h:1/0"
