"""The supervisor's restart, backoff, crash-loop and drain rules, with fake processes and a fake clock."""

from __future__ import annotations

import signal
import threading

import pytest

from worker.app.supervisor import RestartPolicy, Supervisor, check_ports, child_env, describe_exit, supervise
from worker.config.settings import Config, ConfigError, DeliveryConfig, KafkaConfig, MetricsConfig


class FakeChild:
    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.rc: int | None = None
        self.signals: list[int] = []
        self.killed = False
        self.exit_on_term: int | None = 0  # the code it exits with at SIGTERM; None: ignores it

    def poll(self) -> int | None:
        return self.rc

    def send_signal(self, sig: int) -> None:
        self.signals.append(sig)
        if sig == signal.SIGTERM and self.exit_on_term is not None:
            self.rc = self.exit_on_term

    def kill(self) -> None:
        self.killed = True
        self.rc = -9


class Factory:
    def __init__(self) -> None:
        self.started: list[tuple[int, FakeChild]] = []

    def __call__(self, index: int) -> FakeChild:
        child = FakeChild(1000 + len(self.started))
        self.started.append((index, child))
        return child

    def live(self, index: int) -> FakeChild:
        return [c for i, c in self.started if i == index][-1]


POLICY = RestartPolicy(backoff_s=1.0, max_backoff_s=8.0, stable_s=60.0, max_exits=5, exit_window_s=120.0)


def make(n: int = 2, drain_s: float = 30.0) -> tuple[Supervisor, Factory]:
    f = Factory()
    sup = Supervisor(f, n, drain_s=drain_s, policy=POLICY)
    sup.start(0.0)
    return sup, f


def test_starts_one_child_per_index_and_drains_to_zero():
    sup, f = make(3)
    assert [i for i, _ in f.started] == [0, 1, 2]
    sup.step(1.0)
    assert sup.exit_code is None
    sup.request_stop(2.0)
    assert all(c.signals == [signal.SIGTERM] for _, c in f.started)
    sup.step(2.1)
    assert sup.exit_code == 0


def test_a_dead_child_is_restarted_after_a_doubling_backoff():
    sup, f = make(2)
    times = []
    now = 10.0
    for _ in range(4):
        f.live(1).rc = 1
        sup.step(now)
        exited = now
        # Not before the backoff is over ...
        while len([i for i, _ in f.started if i == 1]) == len(times) + 1:
            now += 0.25
            sup.step(now)
        times.append(now - exited)
        now += 1.0
    assert times == [1.0, 2.0, 4.0, 8.0]
    assert len([i for i, _ in f.started if i == 0]) == 1  # the other child is left alone
    assert sup.restarts == 4


def test_backoff_starts_over_after_a_stable_run():
    sup, f = make(1)
    f.live(0).rc = 1
    sup.step(5.0)
    sup.step(6.0)  # restarted after 1 s
    f.live(0).rc = 1
    sup.step(7.0)  # ran 1 s: streak 2, 2 s backoff
    assert sup.slots[0].restart_at == 9.0
    sup.step(9.0)
    f.live(0).rc = 1
    sup.step(9.0 + 61)  # ran past stable_s: back to 1 s
    assert sup.slots[0].restart_at == pytest.approx(9.0 + 61 + 1.0)


def test_a_crash_looping_child_stops_everything_with_exit_1(caplog):
    sup, f = make(2)
    now = 0.0
    for _ in range(5):
        f.live(0).rc = 1
        now += 0.5
        sup.step(now)
        now = sup.slots[0].restart_at or now
        sup.step(now)
    assert sup.failure is not None and "child 0 exited 5 times within 120 s" in sup.failure
    assert "crash-looping" in sup.failure
    # The other child is drained, not left running.
    assert f.live(1).signals == [signal.SIGTERM]
    sup.step(now + 0.1)
    assert sup.exit_code == 1
    assert len([i for i, _ in f.started if i == 0]) == 5  # no restart after the fifth exit


def test_exits_spread_wider_than_the_window_are_no_crash_loop():
    sup, f = make(1)
    now = 0.0
    for _ in range(8):
        now += 40.0
        f.live(0).rc = 1
        sup.step(now)
        now = sup.slots[0].restart_at or now
        sup.step(now)
    assert sup.failure is None
    assert len(f.started) == 9


def test_a_config_error_in_a_child_ends_with_exit_2():
    sup, f = make(2)
    f.live(1).rc = 2
    sup.step(1.0)
    assert sup.failure is not None and "exited 2" in sup.failure
    sup.step(1.1)
    assert sup.exit_code == 2
    assert len(f.started) == 2


def test_a_child_that_ignores_sigterm_is_killed_after_the_drain_budget():
    sup, f = make(2, drain_s=30.0)
    f.live(1).exit_on_term = None
    sup.request_stop(100.0)
    sup.step(100.1)
    assert sup.exit_code is None and not f.live(1).killed
    sup.step(129.9)
    assert sup.exit_code is None
    sup.step(130.0)
    assert f.live(1).killed
    sup.step(130.1)
    assert sup.exit_code == 1  # killed: not a clean drain


def test_a_child_failing_its_drain_makes_the_exit_code_1():
    sup, f = make(2)
    f.live(0).exit_on_term = 1
    sup.request_stop(1.0)
    sup.step(1.1)
    assert sup.exit_code == 1


def test_no_restart_during_the_drain():
    sup, f = make(2)
    f.live(0).rc = 1
    sup.step(1.0)  # waiting for its restart at 2.0
    sup.request_stop(1.5)
    sup.step(5.0)
    assert len(f.started) == 2
    assert sup.exit_code == 1  # child 0's last exit was not clean


def test_child_env_gives_each_child_its_port_and_transactional_id(monkeypatch):
    monkeypatch.setattr("socket.gethostname", lambda: "host-a")
    cfg = Config(kafka=KafkaConfig(group_id="g", input_topics=["in"]), metrics=MetricsConfig(port=9400),
                 delivery=DeliveryConfig(mode="exactly_once"))
    envs = [child_env(cfg, i, {"KEEP": "1", "WORKER__METRICS__PORT": "1"}, None) for i in range(2)]
    assert [e["WORKER__METRICS__PORT"] for e in envs] == ["9400", "9401"]
    assert [e["WORKER__DELIVERY__TRANSACTIONAL_ID"] for e in envs] == ["g-host-a-0", "g-host-a-1"]
    assert all(e["WORKER__MODEL__PROCESSES"] == "1" and e["KEEP"] == "1" for e in envs)
    assert [e["KIW_PROCESS_INDEX"] for e in envs] == ["0", "1"]
    named = Config(delivery=DeliveryConfig(mode="exactly_once", transactional_id="tx"))
    assert child_env(named, 3, {}, 0)["WORKER__DELIVERY__TRANSACTIONAL_ID"] == "tx-3"
    assert child_env(named, 3, {}, 0)["WORKER__METRICS__PORT"] == "0"  # any free port, each
    assert "WORKER__DELIVERY__TRANSACTIONAL_ID" not in child_env(Config(), 1, {}, None)
    off = Config(metrics=MetricsConfig(enabled=False))
    assert child_env(off, 0, {}, None)["WORKER__METRICS__ENABLED"] == "false"
    assert envs[0]["WORKER__METRICS__ENABLED"] == "true"


def test_ports_past_65535_are_a_config_error_naming_the_source():
    with pytest.raises(ConfigError, match=r"\$\.metrics\.port: 4 processes serve metrics on ports "
                                          r"65534\.\.65537"):
        check_ports(Config(metrics=MetricsConfig(port=65534)), 4, None)
    with pytest.raises(ConfigError, match="--metrics-port"):
        check_ports(Config(), 2, 65535)
    check_ports(Config(metrics=MetricsConfig(port=65534)), 2, None)
    check_ports(Config(metrics=MetricsConfig(enabled=False, port=65534)), 4, None)


def test_describe_exit():
    assert describe_exit(1) == "exited with 1"
    assert describe_exit(-9) == "was killed by SIGKILL"


def test_supervise_drains_on_sigterm_with_the_real_loop():
    f = Factory()
    timer = threading.Timer(0.3, lambda: signal.raise_signal(signal.SIGTERM))
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        timer.start()
        rc = supervise(Config(), "unused.yaml", 2, factory=f)
    finally:
        timer.cancel()
        for s, h in old.items():
            signal.signal(s, h)
    assert rc == 0
    assert len(f.started) == 2 and all(c.signals == [signal.SIGTERM] for _, c in f.started)


@pytest.mark.parametrize(("argv", "want"), [([], 2), (["--processes", "3"], 3), (["--processes", "1"], None)])
def test_worker_run_supervises_per_model_processes_or_the_flag(tmp_path, monkeypatch, argv, want):
    from worker.app import cli

    path = tmp_path / "w.yaml"
    path.write_text("kafka: {input_topics: [in]}\nmodel: {processes: 2}\nmetrics: {enabled: false}\n")
    calls: list[tuple[int, int | None]] = []
    monkeypatch.setattr("worker.app.supervisor.supervise",
                        lambda cfg, p, n, metrics_port=None: calls.append((n, metrics_port)) or 0)
    monkeypatch.setattr("worker.app.service.run_service",
                        lambda cfg, metrics_port=None: calls.append((1, None)) or 0)
    monkeypatch.setattr(cli, "_setup_logging", lambda cfg, level=None: None)
    assert cli.main(["run", "--config", str(path), *argv]) == 0
    assert calls == [(want or 1, None)]


@pytest.mark.parametrize("bad", ["0", "65", "two", "-1"])
def test_processes_flag_out_of_range_is_a_usage_error(bad, capsys):
    from worker.app.cli import build_parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["run", "--config", "x.yaml", "--processes", bad])
    assert e.value.code == 2
    assert "--processes: expected a whole number of processes from 1 to 64" in capsys.readouterr().err
