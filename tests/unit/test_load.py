from __future__ import annotations

import collections
from typing import Any

import msgspec
import pytest

from worker.app.cli import main
from worker.app.load import parse_lanes, requests


def test_parse_lanes():
    assert parse_lanes("high=0.1,low=0.9") == [("high", 0.1), ("low", 0.9)]
    assert parse_lanes(None) == []
    with pytest.raises(ValueError, match="NAME=FRACTION"):
        parse_lanes("high=lots")
    assert parse_lanes("high=0,low=1") == [("high", 0.0), ("low", 1.0)]


@pytest.mark.parametrize("spec, message", [
    ("high=0.1,low=0.9,", "a lane without a name"),  # a trailing comma: it was a lane "" with share 1.0
    ("=1", "a lane without a name"),
    ("high=0,low=0", "every share"),
    ("high=-1,low=2", "finite number >= 0"),
    ("high=nan", "finite number >= 0"),
    ("high=inf", "finite number >= 0"),
])
def test_parse_lanes_rejects_mixes_that_cannot_be_drawn(spec: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_lanes(spec)


@pytest.mark.parametrize("kind", ["tiny", "synthetic", "identity", "minilm"])
def test_requests_are_valid_for_their_model(kind):
    from schemas import Request
    from worker.models.registry import builtin_input_types

    dec = msgspec.json.Decoder(Request[builtin_input_types()[kind]])  # type: ignore[valid-type]
    items = list(requests(50, kind, lanes="high=0.2,low=0.8", id_prefix="x", deadline_ms=1000))
    assert [k for k, _ in items] == [f"x-{i}".encode() for i in range(50)]
    reqs: list[Any] = [dec.decode(v) for _, v in items]
    assert all(r.deadline_ms is not None for r in reqs)
    mix = collections.Counter(r.priority for r in reqs)
    assert set(mix) == {"high", "low"} and mix["low"] > mix["high"]


def test_load_cli_usage_errors_exit_2(capsys):
    assert main(["load", "--topic", "t", "--lanes", "high=x", "--count", "1"]) == 2
    assert "NAME=FRACTION" in capsys.readouterr().err


def test_demo_cli_usage_errors_exit_2_before_starting_anything(capsys):
    assert main(["demo", "--rate", "0"]) == 2
    assert main(["demo", "--records", "-1"]) == 2
    assert main(["demo", "--warm-up-s", "-1"]) == 2
    err = capsys.readouterr().err
    assert (
        "--rate must be > 0" in err and "--records must be > 0" in err and "--warm-up-s must be >= 0" in err
    )


def test_load_reports_an_unreachable_broker_and_exits_1(capsys, monkeypatch):
    import worker.app.load

    monkeypatch.setattr(worker.app.load, "CONNECT_TIMEOUT_S", 1.0)
    # A closed port: no broker at all (not a fake of one); nothing can be delivered.
    assert main(["load", "--topic", "t", "--count", "5", "--bootstrap", "127.0.0.1:1"]) == 1
    err = capsys.readouterr().err
    assert "cannot reach Kafka at 127.0.0.1:1 within 1 s" in err


@pytest.mark.parametrize("argv", [
    ["demo", "--rate", "nan"], ["demo", "--rate", "inf"], ["demo", "--warm-up-s", "inf"],
    ["demo", "--warm-up-s", "nan"],
    ["load", "--topic", "t", "--rate", "nan"], ["load", "--topic", "t", "--rate", "inf"],
])
def test_a_non_finite_number_is_a_usage_error(argv, capsys, monkeypatch):
    """nan passed every range check (--rate nan meant unthrottled) and inf overflowed once the demo ran."""
    import worker.app.demo
    import worker.app.load

    monkeypatch.setattr(worker.app.demo, "demo", lambda **kw: pytest.fail("started"))
    monkeypatch.setattr(worker.app.load, "produce", lambda *a, **kw: pytest.fail("started"))
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    assert f"argument {argv[-2]}: expected a finite number, got '{argv[-1]}'" in capsys.readouterr().err


def test_a_deadline_outside_the_schema_range_is_a_usage_error(capsys, monkeypatch):
    """Every record got a deadline_ms past +-2^53, which the worker refuses (a validate dead letter each), and
    load said "produced N records" with exit 0."""
    import worker.app.load

    monkeypatch.setattr(worker.app.load, "produce", lambda *a, **kw: pytest.fail("started"))
    assert main(["load", "--topic", "t", "--count", "1", "--deadline-ms", str(2**60)]) == 2
    assert "--deadline-ms" in capsys.readouterr().err


def test_a_paced_request_gets_its_deadline_when_it_is_sent(monkeypatch):
    """The next request was made before the pacing sleep, so its deadline counted from up to 1/rate before it
    was sent: at --rate 2 --deadline-ms 200, records were produced 300 ms past their deadline."""
    import worker.app.load

    clock = [1000.0]
    monkeypatch.setattr(worker.app.load.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(worker.app.load.time, "time", lambda: clock[0])
    monkeypatch.setattr(worker.app.load.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    sent: list[tuple[float, int]] = []

    class Producer:
        def list_topics(self, timeout: float) -> None:
            return None

        def produce(self, topic: str, value: bytes, key: bytes, on_delivery) -> None:
            sent.append((clock[0], msgspec.json.decode(value)["deadline_ms"]))
            on_delivery(None, None)

        def poll(self, timeout: float) -> int:
            return 0

        def flush(self, timeout: float) -> int:
            return 0

    n = worker.app.load.produce("b", "t", worker.app.load.requests(3, deadline_ms=200), rate=2,
                                producer=Producer())
    assert n == 3
    assert all(deadline - at * 1000 == pytest.approx(200) for at, deadline in sent), sent
