"""How far a priority lane's partial batch is filled from lower lanes (``fill_efficiency``), and what the
lane defaults give under overload (replayed by ``tests.bench.overload_sim`` on the real scheduler)."""

from __future__ import annotations

import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tests.bench.latency import W_HIGH, W_LOW
from tests.bench.overload_sim import simulate
from tests.support.props import examples
from tests.unit.fakes import ids, lanes, recs
from worker.config.settings import ConfigError, LaneConfig, from_dict
from worker.core.latency import LatencyModel, efficient_size
from worker.core.records import Record
from worker.core.scheduler import PriorityScheduler


def model(a: float, b: float) -> LatencyModel:
    m = LatencyModel()
    for n in (1, 8, 32, 4):
        m.observe(n, a + b * n)
    return m


def throughput(a: float, b: float, n: int) -> float:
    return n / (a + b * n)


# ---------------------------------------------------------------- efficient_size

def test_efficient_size_on_the_benchmarks_device() -> None:
    m = model(0.020, 0.001)  # a = 20 ms, b = 1 ms: a full batch of 32 serves 615/s
    assert efficient_size(m, 32, 1.0) == 32
    assert efficient_size(m, 32, 0.97) == 30  # 600/s, 0.975 of a full batch's rate
    assert efficient_size(m, 32, 0.9) == 25
    assert efficient_size(model(0.0, 0.001), 32, 0.5) == 32  # no fixed cost: nothing to amortise


@settings(max_examples=examples(300), deadline=None)
@given(a=st.floats(1e-5, 0.1), b=st.floats(1e-6, 0.01), full=st.integers(1, 512), eff=st.floats(0.05, 1.0))
@example(a=0.02, b=0.001, full=32, eff=0.97)
@example(a=1e-5, b=0.01, full=512, eff=0.05)
def test_efficient_size_is_the_smallest_size_reaching_the_fraction(a: float, b: float, full: int,
                                                                   eff: float) -> None:
    m = LatencyModel()
    m.a, m.b = a, b
    n = efficient_size(m, full, eff)
    assert 1 <= n <= full
    goal = eff * throughput(a, b, full)
    assert throughput(a, b, n) >= goal * (1 - 1e-9)
    if n > 1:
        assert throughput(a, b, n - 1) < goal * (1 + 1e-9)


# ---------------------------------------------------------------- configuration

def test_a_lane_fills_by_default_and_stops_short_of_a_full_batch() -> None:
    lane = LaneConfig(name="x")
    assert lane.fill_with_lower is True and lane.fill_efficiency == 0.97
    assert lane.settings().fill_efficiency == 0.97


@pytest.mark.parametrize("bad", [0, 1.5, -0.1])
def test_fill_efficiency_out_of_range_names_its_path(bad: float) -> None:
    with pytest.raises(ConfigError, match=r"\$\.batching\.lanes\[0\]\.fill_efficiency"):
        from_dict({"batching": {"lanes": [{"name": "default", "fill_efficiency": bad}]}}, environ={})


# ---------------------------------------------------------------- the scheduler

def two(eff: float, batch: int = 32) -> PriorityScheduler:
    cfg = lanes({"name": "hi", "priority": 1, "max_batch_size": batch, "max_wait_ms": 0,
                 "fill_efficiency": eff},
                {"name": "lo", "max_batch_size": batch, "max_wait_ms": 0})
    return PriorityScheduler(cfg, "lo")


def feed(s: PriorityScheduler, rs: list[Record], now: float) -> None:
    for r in rs:
        assert s.add(r, now) == []


def train(s: PriorityScheduler, a: float = 0.020, b: float = 0.001) -> None:
    for n in (1, 8, 32, 4):
        s.observe("hi", n, a + b * n)


def test_a_filled_batch_stops_at_the_efficient_size_once_the_device_is_known() -> None:
    s = two(0.97)
    train(s)
    high, low = recs(3, "hi"), recs(60, "lo")
    feed(s, low, now=0.0)
    feed(s, high, now=0.0)
    b = s.next_batch(0.001)
    assert b is not None and b.lane == "hi" and b.mixed
    assert len(b) == 30 and ids(b.records) == ids(high + low[:27])
    # The low lane's own batches still run full.
    nxt = s.next_batch(0.001)
    assert nxt is not None and nxt.lane == "lo" and len(nxt) == 32


def test_before_the_model_is_fitted_and_at_efficiency_one_it_fills_to_max_batch_size() -> None:
    for eff, trained in ((0.97, False), (1.0, True)):
        s = two(eff)
        if trained:
            train(s)
        feed(s, recs(60, "lo"), now=0.0)
        feed(s, recs(3, "hi"), now=0.0)
        b = s.next_batch(0.001)
        assert b is not None and b.lane == "hi" and len(b) == 32


def test_the_fill_limit_follows_the_fitted_cost_shape() -> None:
    """A device whose fixed cost is small against the per-record cost gains little from the last records of a
    full batch, so a filled batch stays much shorter there."""
    s = two(0.97)
    train(s, a=0.001, b=0.001)  # a = b: a full batch of 32 runs at 0.97 of 1/b already
    feed(s, recs(60, "lo"), now=0.0)
    feed(s, recs(2, "hi"), now=0.0)
    b = s.next_batch(0.001)
    assert b is not None and b.lane == "hi"
    assert len(b) == efficient_size(s._policy.fitted(s._lanes["hi"]), 32, 0.97) < 20  # type: ignore[arg-type]


def test_a_batch_whose_own_records_exceed_the_limit_takes_no_fill() -> None:
    s = two(0.97)
    train(s)
    high = recs(31, "hi")
    feed(s, recs(10, "lo"), now=0.0)
    feed(s, high, now=0.0)
    b = s.next_batch(0.001)
    assert b is not None and ids(b.records) == ids(high) and not b.mixed


# ---------------------------------------------------------------- the defaults under overload (replayed)

@pytest.mark.parametrize("seed", [1, 2, 3])
def test_the_lane_defaults_serve_the_device_and_keep_the_high_lanes_p99(seed: int) -> None:
    """Issue 24's targets with the settings a user gets by default (the bench's priorities and weights
    only): served / capacity >= 0.95 and the high lane's p99 at 2x overload <= 2.3x its p99 at 10% load."""
    light = simulate(10.0, load=0.1, seconds=20.0, seed=seed, defaults=True)
    over = simulate(10.0, load=2.0, seconds=20.0, seed=seed, defaults=True)
    assert over.capacity_fraction >= 0.95
    assert over.high_p99_ms <= 2.3 * light.high_p99_ms
    assert over.low_share >= W_LOW / (W_LOW + W_HIGH)


def test_a_lower_fill_efficiency_trades_throughput_for_high_lane_latency() -> None:
    curve = [simulate(10.0, load=2.0, seconds=20.0, seed=3, fill=True, efficiency=e)
             for e in (1.0, 0.97, 0.9)]
    caps = [o.capacity_fraction for o in curve]
    p99s = [o.high_p99_ms for o in curve]
    assert caps == sorted(caps, reverse=True) and caps[-1] < 0.93 < caps[0]
    assert p99s == sorted(p99s, reverse=True) and p99s[0] - p99s[-1] > 8.0
    assert all(math.isfinite(x) for x in p99s)
