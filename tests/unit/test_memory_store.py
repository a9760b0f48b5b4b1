from __future__ import annotations

from collections import OrderedDict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.props import examples
from worker.config.settings import RedisConfig
from worker.store.from_config import make_store
from worker.store.memory_store import MemoryStore, as_time_fn, cache_key


class Clock:
    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def now(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


def store(**kw: object) -> tuple[MemoryStore, Clock]:
    clock = Clock()
    return MemoryStore(clock=clock, **kw), clock  # type: ignore[arg-type]


def test_cache_key_is_sha256_hex_and_separates_fields() -> None:
    k = cache_key("m", "1", b"hello")
    assert len(k) == 64 and int(k, 16) >= 0
    assert k == cache_key("m", "1", b"hello")
    assert k != cache_key("m", "2", b"hello")
    assert k != cache_key("m", "1", b"hellO")
    # length prefixes: moving a character between name and version changes the key
    assert cache_key("ab", "c", b"") != cache_key("a", "bc", b"")
    assert cache_key("m", "1", b"x") != cache_key("m", "1x", b"")


def test_cache_roundtrip_and_ttl() -> None:
    s, clock = store(cache_ttl_s=10)
    assert s.get_cached("k") is None
    s.put_cached("k", b"v")
    assert s.get_cached("k") == b"v"
    clock.advance(9.9)
    assert s.get_cached("k") == b"v"
    clock.advance(0.2)
    assert s.get_cached("k") is None
    assert s.sizes()["cache"] == 0  # expired entries are dropped on read


def test_cache_lru_eviction_keeps_recently_read() -> None:
    s, _ = store(max_cache_entries=3)
    for k in "abc":
        s.put_cached(k, k.encode())
    assert s.get_cached("a") == b"a"  # a is now most recent; b is the LRU
    s.put_cached("d", b"d")
    assert s.get_cached("b") is None
    assert [s.get_cached(k) for k in "acd"] == [b"a", b"c", b"d"]
    assert s.sizes()["cache"] == 3


def test_cache_disabled_is_always_a_miss() -> None:
    s, _ = store(cache=False)
    s.put_cached("k", b"v")
    assert s.get_cached("k") is None


def test_ledger_ttl_and_batch_lookup() -> None:
    s, clock = store(ledger_ttl_s=60)
    assert not s.was_delivered("r1")
    s.mark_delivered(["r1", "r2"])
    s.mark_delivered([])
    assert s.was_delivered("r1") and s.was_delivered("r2")
    assert s.delivered_many(["r0", "r1", "r2", "r3"]) == {"r1", "r2"}
    assert s.delivered_many([]) == set()
    clock.advance(30)
    s.mark_delivered(["r3"])
    clock.advance(31)
    assert s.delivered_many(["r1", "r2", "r3"]) == {"r3"}


def test_ledger_disabled() -> None:
    s, _ = store(ledger=False)
    s.mark_delivered(["a"])
    assert not s.was_delivered("a") and s.delivered_many(["a"]) == set()


def test_ledger_is_bounded_oldest_first() -> None:
    s, _ = store(max_ledger_entries=2)
    s.mark_delivered(["a", "b", "c"])
    assert s.delivered_many(["a", "b", "c"]) == {"b", "c"}


def test_attempts_count_clear_and_expire() -> None:
    s, clock = store(attempts_ttl_s=100)
    assert [s.incr_attempts("x") for _ in range(3)] == [1, 2, 3]
    assert s.incr_attempts("y") == 1
    s.clear_attempts(["x", "missing"])
    assert s.incr_attempts("x") == 1
    clock.advance(99)
    assert s.incr_attempts("y") == 2  # each INCR pushes the expiry out again
    clock.advance(99)
    assert s.incr_attempts("y") == 3
    clock.advance(101)
    assert s.incr_attempts("y") == 1


def test_purge_expired() -> None:
    s, clock = store(cache_ttl_s=1, ledger_ttl_s=2, attempts_ttl_s=3)
    s.put_cached("k", b"v")
    s.mark_delivered(["r"])
    s.incr_attempts("a")
    clock.advance(2.5)
    assert s.purge_expired() == 2
    assert s.sizes() == {"cache": 0, "ledger": 0, "attempts": 1}


def test_validation_errors_name_the_setting() -> None:
    with pytest.raises(ValueError, match="cache_ttl_s must be > 0"):
        MemoryStore(cache_ttl_s=0)
    with pytest.raises(ValueError, match="max_entries must be >= 1"):
        MemoryStore(max_cache_entries=0)


def test_clock_may_be_a_callable_or_clock_object() -> None:
    assert as_time_fn(lambda: 5.0)() == 5.0
    assert as_time_fn(Clock(7.0))() == 7.0
    with pytest.raises(TypeError):
        as_time_fn(42)  # type: ignore[arg-type]


def test_make_store_without_url_is_memory_with_config_ttls() -> None:
    cfg = RedisConfig(cache=True, cache_ttl_s=5, ledger_ttl_s=7, attempts_ttl_s=9)
    clock = Clock()
    s = make_store(cfg, clock=clock)
    assert isinstance(s, MemoryStore)
    assert (s.cache_ttl_s, s.ledger_ttl_s, s.attempts_ttl_s) == (5, 7, 9)
    s.put_cached("k", b"v")
    clock.advance(5)
    assert s.get_cached("k") is None
    assert make_store(RedisConfig()).get_cached("k") is None  # cache is off by default


@settings(max_examples=examples(60), deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["get", "put"]), st.integers(0, 6)), max_size=60))
def test_lru_matches_a_reference_model(ops: list[tuple[str, int]]) -> None:
    s, _ = store(max_cache_entries=3)
    ref: OrderedDict[str, bytes] = OrderedDict()
    for op, i in ops:
        key = f"k{i}"
        if op == "put":
            s.put_cached(key, key.encode())
            ref[key] = key.encode()
            ref.move_to_end(key)
            while len(ref) > 3:
                ref.popitem(last=False)
        else:
            expected = ref.get(key)
            if expected is not None:
                ref.move_to_end(key)
            assert s.get_cached(key) == expected


def test_get_cached_many_returns_only_hits() -> None:
    s, clock = store(cache_ttl_s=10)
    assert s.get_cached_many([]) == {}
    s.put_cached("a", b"1")
    clock.advance(5)
    s.put_cached("b", b"2")
    assert s.get_cached_many(["a", "b", "c", "a"]) == {"a": b"1", "b": b"2"}
    clock.advance(6)  # a expired, b not
    assert s.get_cached_many(["a", "b"]) == {"b": b"2"}
    assert s.sizes()["cache"] == 1
    off, _ = store(cache=False)
    off.put_cached("a", b"1")
    assert off.get_cached_many(["a"]) == {}


def test_get_cached_many_refreshes_lru_like_get_cached() -> None:
    s, _ = store(max_cache_entries=2)
    s.put_cached("a", b"a")
    s.put_cached("b", b"b")
    assert s.get_cached_many(["a"]) == {"a": b"a"}  # a becomes most recent
    s.put_cached("c", b"c")
    assert s.get_cached_many(["a", "b", "c"]) == {"a": b"a", "c": b"c"}


def test_incr_attempts_many_matches_per_key_calls() -> None:
    s, clock = store(attempts_ttl_s=100)
    assert s.incr_attempts_many([]) == []
    assert s.incr_attempts_many(["t:0:1", "t:0:2"]) == [1, 1]
    assert s.incr_attempts("t:0:1") == 2
    assert s.incr_attempts_many(["t:0:1", "t:0:3", "t:0:1"]) == [3, 1, 4]  # listed twice counts twice
    s.clear_attempts(["t:0:1"])
    s.clear_attempts([])
    assert s.incr_attempts_many(["t:0:1", "t:0:2"]) == [1, 2]
    clock.advance(101)
    assert s.incr_attempts_many(["t:0:2", "t:0:3"]) == [1, 1]


@settings(max_examples=examples(40), deadline=None)
@given(st.lists(st.lists(st.sampled_from(["a", "b", "c"]), max_size=5), max_size=8))
def test_incr_attempts_many_equals_sequential_incr(batches: list[list[str]]) -> None:
    many, _ = store()
    one, _ = store()
    for keys in batches:
        assert many.incr_attempts_many(keys) == [one.incr_attempts(k) for k in keys]


def test_put_cached_many_and_get_attempts_many() -> None:
    s, clock = store(cache_ttl_s=10)
    s.put_cached_many([])
    s.put_cached_many([("a", b"1"), ("b", bytearray(b"2"))])
    assert s.get_cached_many(["a", "b"]) == {"a": b"1", "b": b"2"}
    clock.advance(10)
    assert s.get_cached_many(["a", "b"]) == {}
    off, _ = store(cache=False)
    off.put_cached_many([("a", b"1")])
    assert off.get_cached_many(["a"]) == {}

    assert s.get_attempts_many([]) == []
    s.incr_attempts_many(["x", "x", "y"])
    assert s.get_attempts_many(["x", "y", "z"]) == [2, 1, 0]
    assert s.get_attempts_many(["x"]) == [2]  # reading does not count
