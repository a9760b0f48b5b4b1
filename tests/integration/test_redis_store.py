"""RedisStore against a real redis-server (REDIS_URL, testcontainers, or a LocalRedis; see
tests/conftest_redis.py)."""

from __future__ import annotations

import logging
import subprocess
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import redis

from tests.support import needs
from worker.config.settings import RedisConfig
from worker.local.redis_server import LocalRedis
from worker.observability.metrics import PrometheusMetrics
from worker.store.from_config import make_store
from worker.store.redis_store import RedisStore

pytestmark = pytest.mark.integration


def cfg(url: str, **kw: object) -> RedisConfig:
    base: dict[str, object] = {"url": url, "key_prefix": f"kiw-test:{uuid.uuid4().hex[:10]}:", "cache": True,
                               "ledger": True, "timeout_ms": 500}
    base.update(kw)
    return RedisConfig(**base)  # type: ignore[arg-type]


def errors(m: PrometheusMetrics, op: str) -> float:
    return m.registry.get_sample_value("kiw_redis_errors_total", {"op": op}) or 0.0


def circuit_open(m: PrometheusMetrics) -> float | None:
    return m.registry.get_sample_value("kiw_redis_circuit_open")


def test_cache_roundtrip_with_ttl(redis_url: str) -> None:
    c = cfg(redis_url, cache_ttl_s=1)
    store = RedisStore(c)
    raw = redis.Redis.from_url(redis_url)
    try:
        assert store.get_cached("abc") is None
        store.put_cached("abc", b"\x00result\xff")
        assert store.get_cached("abc") == b"\x00result\xff"
        assert 0 < raw.pttl(f"{c.key_prefix}cache:abc") <= 1000
        time.sleep(1.1)
        assert store.get_cached("abc") is None
    finally:
        store.close()
        raw.close()


def test_ledger_and_attempts(redis_url: str) -> None:
    c = cfg(redis_url, ledger_ttl_s=600, attempts_ttl_s=300)
    store = make_store(c)
    assert isinstance(store, RedisStore)
    raw = redis.Redis.from_url(redis_url)
    try:
        assert store.ping()
        assert not store.was_delivered("r1")
        ids = [f"r{i}" for i in range(500)]
        store.mark_delivered(ids[::2])
        assert store.was_delivered("r0") and not store.was_delivered("r1")
        assert store.delivered_many(ids) == set(ids[::2])
        assert store.delivered_many([]) == set()
        assert 590 <= raw.ttl(f"{c.key_prefix}delivered:r0") <= 600

        assert [store.incr_attempts("t/0/42") for _ in range(3)] == [1, 2, 3]
        assert 290 <= raw.ttl(f"{c.key_prefix}attempts:t/0/42") <= 300
        store.clear_attempts(["t/0/42", "t/0/43"])
        assert store.incr_attempts("t/0/42") == 1
    finally:
        leftover = raw.keys(f"{c.key_prefix}*")
        if leftover:
            raw.delete(*leftover)
        store.close()
        raw.close()


def _calls(raw: redis.Redis, *commands: str) -> int:
    stats = raw.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in commands)


def test_batched_ops_are_one_round_trip_each(local_redis: LocalRedis) -> None:
    """get_cached_many = one MGET, incr_attempts_many = one MULTI of INCR+EXPIRE, clear_attempts = DELs in one
    pipeline; results equal the per-key calls. An owned server, so commandstats counts only this test."""
    c = cfg(local_redis.url, attempts_ttl_s=300)
    store = RedisStore(c)
    raw = redis.Redis.from_url(local_redis.url)
    try:
        assert store.get_cached_many([]) == {} and store.incr_attempts_many([]) == []
        store.put_cached("a", b"\x00A")
        store.put_cached("b", b"B")
        mget0 = _calls(raw, "mget")
        assert store.get_cached_many(["a", "x", "b", "a"]) == {"a": b"\x00A", "b": b"B"}
        assert _calls(raw, "mget") == mget0 + 1

        keys = [f"t:0:{i}" for i in range(300)]
        multi0, incr0, exec0 = _calls(raw, "multi"), _calls(raw, "incr", "incrby"), _calls(raw, "exec")
        assert store.incr_attempts_many(keys) == [1] * 300
        after = (_calls(raw, "multi"), _calls(raw, "incr", "incrby"), _calls(raw, "exec"))
        assert after == (multi0 + 1, incr0 + 300, exec0 + 1)
        assert store.incr_attempts("t:0:7") == 2
        assert store.incr_attempts_many(["t:0:7", "t:0:8", "t:0:7"]) == [3, 2, 4]  # listed twice counts twice
        assert 290 <= raw.ttl(f"{c.key_prefix}attempts:t:0:299") <= 300

        many = [f"t:1:{i}" for i in range(2500)]
        store.incr_attempts_many(many)
        del0 = _calls(raw, "del")
        store.clear_attempts(keys + many)
        assert _calls(raw, "del") == del0 + 3  # 2,800 keys in DELs of <= 1,000, one pipeline
        assert raw.keys(f"{c.key_prefix}attempts:*") == []
        assert store.incr_attempts_many(["t:0:7"]) == [1]

        mget0 = _calls(raw, "mget")
        assert store.get_attempts_many(["t:0:7", "t:9:9"]) == [1, 0]
        assert store.get_attempts_many(["t:0:7"]) == [1]  # reading does not count
        assert _calls(raw, "mget") == mget0 + 2
        set0 = _calls(raw, "set")
        store.put_cached_many([(f"c{i}", f"v{i}".encode()) for i in range(200)])
        assert _calls(raw, "set") == set0 + 200
        assert store.get_cached_many(["c0", "c199"]) == {"c0": b"v0", "c199": b"v199"}
        assert 0 < raw.ttl(f"{c.key_prefix}cache:c7") <= c.cache_ttl_s
    finally:
        store.close()
        raw.close()


def test_batched_ops_return_misses_on_outage(local_redis: LocalRedis) -> None:
    m = PrometheusMetrics()
    store = RedisStore(cfg(local_redis.url, breaker_failures=1, breaker_reset_s=30, timeout_ms=200), m)
    try:
        store.put_cached("a", b"1")
        assert store.get_cached_many(["a"]) == {"a": b"1"}
        local_redis.stop()
        assert store.incr_attempts_many(["k1", "k2", "k3"]) == [0, 0, 0]  # reaches the dead port, opens
        assert store.breaker.state == "open"
        assert store.get_cached_many(["a", "b"]) == {}
        store.clear_attempts(["k1"])
        assert store.get_attempts_many(["k1", "k2"]) == [0, 0]
        store.put_cached_many([("a", b"2")])
        assert store.incr_attempts_many([]) == [] and store.get_cached_many([]) == {}  # no call at all
        assert store.get_attempts_many([]) == []
        assert errors(m, "incr_attempts_many") == 1 and errors(m, "get_cached_many") == 1
        assert errors(m, "clear_attempts") == 1
        assert errors(m, "get_attempts_many") == 1 and errors(m, "put_cached_many") == 1
    finally:
        store.close()


def test_password_protected_server(local_redis_factory: Callable[..., LocalRedis],
                                   caplog: pytest.LogCaptureFixture) -> None:
    secret = "pa:ss@w/rd-" + uuid.uuid4().hex[:6]
    server = local_redis_factory(password=secret)
    caplog.set_level(logging.DEBUG)
    m = PrometheusMetrics()

    via_cfg = RedisStore(cfg(server.url_without_password, password=secret))
    via_url = RedisStore(cfg(server.url))  # the password percent-encoded in the URL
    wrong = RedisStore(cfg(server.url_without_password, password="nope", breaker_failures=1), m)
    try:
        via_cfg.put_cached("k", b"v")
        assert via_cfg.get_cached("k") == b"v"
        assert via_url.incr_attempts("a") == 1
        assert wrong.get_cached("k") is None  # auth failure is a soft miss, never an exception
        assert errors(m, "get_cached") == 1 and circuit_open(m) == 1
        for text in (repr(via_cfg), repr(via_url), via_url.url, caplog.text):
            assert secret not in text
    finally:
        for s in (via_cfg, via_url, wrong):
            s.close()


def test_outage_returns_misses_fast_and_recovers(local_redis: LocalRedis) -> None:
    m = PrometheusMetrics()
    store = RedisStore(cfg(local_redis.url, breaker_failures=2, breaker_reset_s=1.0, timeout_ms=200), m)
    try:
        store.put_cached("k", b"v")
        store.mark_delivered(["r1"])
        assert store.get_cached("k") == b"v" and store.was_delivered("r1")

        local_redis.stop()
        for _ in range(2):  # these reach the dead port and open the breaker
            assert store.get_cached("k") is None
        assert store.breaker.state == "open" and circuit_open(m) == 1
        misses = [store.get_cached("k"), store.was_delivered("r1"), store.delivered_many(["r1"]),
                  store.incr_attempts("a")]
        store.put_cached("k2", b"x")
        store.mark_delivered(["r2"])
        store.clear_attempts(["a"])
        assert misses == [None, False, set(), 0]
        reached = _count_client_use(store)
        for _ in range(50):
            store.get_cached("k")
        assert reached == []  # open circuit: the client (the network) is not even touched
        assert errors(m, "get_cached") >= 52 and errors(m, "incr_attempts") == 1

        local_redis.start()  # same port, empty data (nothing persisted)
        time.sleep(1.05)
        assert store.was_delivered("r1") is False  # data is gone, but the call went through...
        assert store.breaker.state == "closed" and circuit_open(m) == 0  # ...and closed the circuit
        store.put_cached("k", b"again")
        assert store.get_cached("k") == b"again"
    finally:
        store.close()


def _count_client_use(store: RedisStore) -> list[int]:
    """Every use of the store's Redis client from now on appends to the returned list."""
    reached: list[int] = []
    client = store._client

    def counted() -> redis.Redis:
        reached.append(1)
        return client()

    store._client = counted  # type: ignore[method-assign]
    return reached


def test_hung_server_is_bounded_by_the_socket_timeout(local_redis: LocalRedis) -> None:
    m = PrometheusMetrics()
    store = RedisStore(cfg(local_redis.url, breaker_failures=2, breaker_reset_s=30, timeout_ms=100), m)
    try:
        assert store.ping()
        local_redis.pause()  # accepts connections, never answers
        t0 = time.monotonic()
        assert store.get_cached("k") is None
        assert store.incr_attempts("k") == 0
        # Two timeouts of 0.1 s. Not a performance figure: a bound on blocking (a hung server must not hold
        # the loop thread), with 10x slack for a busy machine.
        assert time.monotonic() - t0 < 2.0
        assert store.breaker.state == "open"
        reached = _count_client_use(store)
        assert store.delivered_many(["a", "b"]) == set()
        assert reached == []  # open: answered without waiting on the hung server
    finally:
        local_redis.resume()
        store.close()


def _self_signed(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
         "-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True)
    return cert, key


def test_tls_with_ca_file_and_password(local_redis_factory: Callable[..., LocalRedis],
                                       tmp_path: Path) -> None:
    needs.command("openssl")  # makes the test certificate (setup_env.sh installs it)
    cert, key = _self_signed(tmp_path)
    server = local_redis_factory(password="tls-pw", tls_cert_file=cert, tls_key_file=key)
    assert server.url_without_password.startswith("rediss://")
    plain_url = server.url_without_password.replace("rediss://", "redis://")
    stores = [
        RedisStore(cfg(plain_url, tls=True, tls_ca_file=str(cert), password="tls-pw")),
        RedisStore(cfg(server.url, tls_ca_file=str(cert))),
    ]
    untrusted = RedisStore(cfg(server.url, breaker_failures=1))  # no CA: the self-signed cert is rejected
    try:
        for s in stores:
            s.put_cached("k", b"tls")
            assert s.get_cached("k") == b"tls"
        assert untrusted.get_cached("k") is None and untrusted.breaker.state == "open"
    finally:
        for s in [*stores, untrusted]:
            s.close()
