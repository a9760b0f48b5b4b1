"""What the ``worker`` command says when something is wrong: one line naming the cause and the key or flag to
fix, the exit code README promises, no traceback."""

from __future__ import annotations

import logging
import os
import signal
import socket
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from worker.app.cli import build_parser, main

CLOSED = "127.0.0.1:1"  # a closed port: no broker at all (not a fake of one)


@pytest.fixture(autouse=True)
def _keep_signal_handlers() -> Iterator[None]:
    """``worker run`` installs SIGINT/SIGTERM handlers of its own; pytest's must come back."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


@pytest.fixture
def no_log_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("worker.app.cli._setup_logging", lambda cfg, level=None: None)


def _config(tmp_path: Path, model: str = "{name: tiny, device: cpu}", extra: str = "") -> str:
    f = tmp_path / "c.yaml"
    f.write_text(f"kafka: {{bootstrap_servers: '{CLOSED}', input_topics: [in], output_topic: out, "
                 f"dlq_topic: dlq}}\nmodel: {model}\n{extra}")
    return str(f)


def test_top_level_help_lists_the_exit_codes() -> None:
    text = " ".join(build_parser().format_help().split())
    assert ("Exit codes: 0 ok, 1 runtime failure, 2 bad configuration or usage (the message names the bad "
            "key), 130 interrupted") in text


def test_the_fatal_error_log_line_names_the_cause(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                   caplog: pytest.LogCaptureFixture,
                                                  no_log_setup: None) -> None:
    import worker.app.service

    def boom(cfg: object, metrics_port: int | None = None) -> int:
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(worker.app.service, "run_service", boom)
    with caplog.at_level(logging.ERROR, logger="worker"):
        assert main(["run", "--config", _config(tmp_path)]) == 1
    # A JSON log's msg is what log search shows: "fatal error" alone says nothing.
    assert [r.getMessage() for r in caplog.records] == ["fatal error: RuntimeError: disk on fire"]


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_metrics_port_out_of_range_is_a_usage_error(port: str, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    import worker.app.service

    monkeypatch.setattr(worker.app.service, "run_service", lambda cfg, metrics_port=None: 0)
    with pytest.raises(SystemExit) as e:
        main(["run", "--config", _config(tmp_path), "--metrics-port", port])
    assert e.value.code == 2
    assert "port must be 0-65535" in capsys.readouterr().err


def test_metrics_port_in_use_names_the_port_and_its_flag(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                         no_log_setup: None) -> None:
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["run", "--config", _config(tmp_path), "--metrics-port", str(port)]) == 1
    err = capsys.readouterr().err
    assert (
        f"error: cannot serve metrics on 0.0.0.0:{port} ($.metrics.host, --metrics-port): "
        "address already in use"
        in err
    )
    assert "Traceback" not in err


def test_a_cuda_device_without_cuda_is_a_config_error(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch,
                                                      no_log_setup: None) -> None:
    # A machine without CUDA, wherever the test runs (it skipped on one with CUDA).
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    # Refused before anything opens or connects (the metrics port, the runner's clients and model load).
    monkeypatch.setattr("worker.observability.health.HealthServer.start",
                        lambda self: pytest.fail("metrics port opened"))
    monkeypatch.setattr("worker.pipeline.runner.Runner", lambda *a, **kw: pytest.fail("runner started"))
    cfg = _config(tmp_path, model="{name: tiny, device: cuda}", extra="metrics: {enabled: true, port: 0}\n")
    assert main(["run", "--config", cfg]) == 2
    err = capsys.readouterr().err
    assert "config error: $.model.device: 'cuda' requested but CUDA is not available" in err
    # check-config: valid (it may run on a CI machine without the GPU), with a note on what run would do here.
    assert main(["check-config", "--config", cfg]) == 0
    assert "note: $.model.device: 'cuda' requested but CUDA is not available" in capsys.readouterr().err


def test_a_property_librdkafka_refuses_stops_run_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """It used to exit 1 with a traceback when the consumer was made, after the model load."""
    monkeypatch.setattr("worker.app.service.run_service", lambda *a, **kw: pytest.fail("started"))
    monkeypatch.setenv("WORKER__KAFKA__CONSUMER__SESION_TIMEOUT_MS", "10000")
    assert main(["run", "--config", _config(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        'config error: $.kafka.consumer.sesion.timeout.ms: librdkafka refuses it: No such configuration '
        'property: "sesion.timeout.ms" (set by WORKER__KAFKA__CONSUMER__SESION_TIMEOUT_MS)\n')


def test_a_missing_device_names_its_list_item_and_variable(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                          monkeypatch: pytest.MonkeyPatch,
                                                           no_log_setup: None) -> None:
    """It said $.model.device for every item of model.devices, and never which variable set it."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    monkeypatch.setenv("WORKER__MODEL__DEVICES", "[cpu, cuda:1]")
    assert main(["run", "--config", _config(tmp_path)]) == 2
    assert capsys.readouterr().err == ("config error: $.model.devices[1]: 'cuda:1' requested but CUDA is not "
                                       "available on this machine (set by WORKER__MODEL__DEVICES)\n")
    assert main(["check-config", "--config", _config(tmp_path)]) == 0
    assert "note: $.model.devices[1]: 'cuda:1' requested but CUDA is not available on this machine (set by " \
           "WORKER__MODEL__DEVICES) (`worker run` here would exit 2)" in capsys.readouterr().err


def test_a_failed_model_check_names_the_variable(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORKER__MODEL__OPTIONS__HIDEN", "3")
    assert main(["check-config", "--config", _config(tmp_path)]) == 2
    assert capsys.readouterr().err.endswith("(set by WORKER__MODEL__OPTIONS__HIDEN)\n")


def test_dlq_replay_refuses_a_negative_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    t0 = time.monotonic()
    assert main(["dlq", "replay", "--config", _config(tmp_path), "--limit", "-1"]) == 2
    assert time.monotonic() - t0 < 5  # refused before connecting
    assert "usage error: --limit must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("stage", ["", "infrence", "Inference"])
def test_dlq_replay_refuses_a_stage_no_dead_letter_has(stage: str, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    """Such a filter would skip every dead letter and commit past it, then exit 0."""
    import worker.app.dlq
    from worker.config.settings import load

    with pytest.raises(SystemExit) as e:
        main(["dlq", "replay", "--config", _config(tmp_path), "--filter-stage", stage])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --filter-stage: invalid choice" in err and "'inference'" in err
    with pytest.raises(ValueError, match="unknown error stage"):
        worker.app.dlq.replay(load(_config(tmp_path), environ={}), stage=stage,
                          new_consumer=lambda *a, **kw: pytest.fail("connected"))


def test_dlq_replay_reports_an_unreachable_broker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str],
                                                  no_log_setup: None) -> None:
    import worker.app.dlq

    monkeypatch.setattr(worker.app.dlq, "CONNECT_TIMEOUT_S", 1.0)
    assert main(["dlq", "replay", "--config", _config(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert f"error: cannot reach Kafka at {CLOSED} (from $.kafka.bootstrap_servers) within 1 s" in err
    assert "Traceback" not in err


def test_demo_reports_an_unreachable_broker(monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    import worker.app.demo

    monkeypatch.setattr(worker.app.demo, "CONNECT_TIMEOUT_S", 1.0)
    assert main(["demo", "--bootstrap", CLOSED]) == 1
    err = capsys.readouterr().err
    assert f"error: cannot reach Kafka at {CLOSED} (from --bootstrap) within 1 s" in err
    assert "Traceback" not in err


def test_backfill_reports_an_unreachable_broker(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                no_log_setup: None) -> None:
    assert main(["backfill", "--config", _config(tmp_path)]) == 1  # backfill's own metadata timeout: 30 s
    err = capsys.readouterr().err
    assert f"error: cannot reach Kafka at {CLOSED} (from $.kafka.bootstrap_servers) within 30 s" in err
    assert "Traceback" not in err


def test_a_second_ctrl_c_during_the_model_load_exits_130(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         caplog: pytest.LogCaptureFixture,
                                                         no_log_setup: None) -> None:
    # A factory that takes a while to load, during which the user presses Ctrl-C twice.
    (tmp_path / "slow_load.py").write_text(textwrap.dedent('''
        import os, signal, time
        def build():
            for _ in range(2):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.3)
            raise AssertionError("the second Ctrl-C did not interrupt the load")
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = _config(tmp_path, model="{name: 'slow_load:build', device: cpu}")
    with caplog.at_level(logging.WARNING, logger="worker"):
        assert main(["run", "--config", cfg]) == 130
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("stop requested; finishing the model load first" in m for m in msgs) == 1, msgs


def test_ctrl_c_after_the_model_load_is_a_graceful_stop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       caplog: pytest.LogCaptureFixture,
                                                       no_log_setup: None) -> None:
    """Between the model load and the loop (clients being created) the service still treated signals as
    'during the load': it logged 'finishing the model load first', and a second Ctrl-C raised
    KeyboardInterrupt inside the runner's setup, leaving the clients it had created unclosed (exit 130)."""
    from worker.pipeline.lag import LagReport

    def two_ctrl_c(self: object) -> None:  # the runner's first step once its clients are made
        for _ in range(2):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)

    monkeypatch.setattr(LagReport, "check_broker", two_ctrl_c)
    cfg = _config(tmp_path, extra="metrics: {enabled: false}\ndelivery: {shutdown_timeout_s: 1}")
    with caplog.at_level(logging.WARNING, logger="worker"):
        assert main(["run", "--config", cfg]) == 0
    assert not any("finishing the model load first" in r.getMessage() for r in caplog.records)


def test_profile_refuses_an_unwritable_json_path_before_profiling(capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The path is checked before the model is loaded or profiled (minutes on a real model), not at the
    end."""
    def too_late(*a: object, **kw: object) -> None:
        pytest.fail("profile loaded or profiled the model before refusing the unwritable --json path")

    monkeypatch.setattr("worker.models.registry.load_model", too_late)
    monkeypatch.setattr("worker.app.profile.profile_engine", too_late)
    missing = os.path.join(os.sep, "nonexistent-kiw", "x.json")
    assert main(["profile", "--model", "tiny", "--batch-sizes", "1", "--json", missing]) == 2
    err = capsys.readouterr().err
    assert f"error: --json {missing}: folder" in err and "does not exist" in err


def test_a_demo_worker_that_dies_after_start_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    """Past start-up the demo's main thread waits on results for minutes: a worker thread that died there was
    silent, and the demo ended with a misleading message and no cause."""
    import threading

    from worker.app.demo import _WorkerThread

    class Dies:
        ready = threading.Event()

        def run(self) -> None:
            self.ready.set()
            time.sleep(0.05)
            raise RuntimeError("device pipeline exploded")

        def stop(self) -> None:
            pass

    with caplog.at_level(logging.ERROR, logger="worker.demo"):
        w = _WorkerThread(Dies())
        assert w.wait_ready(5)
        w.thread.join(5)
    assert "device pipeline exploded" in caplog.text
    with pytest.raises(RuntimeError, match="device pipeline exploded"):
        w.check()


def test_a_ca_file_not_on_this_machine_fails_run_and_is_a_note_in_check_config(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """check-config made the clients with the pod's CA path, which a CI machine does not have: librdkafka
    refused it and check-config exited 2 on a valid config (the chart's checks of the TLS examples)."""
    monkeypatch.setattr("worker.app.service.run_service", lambda *a, **kw: pytest.fail("started"))
    monkeypatch.setenv("WORKER__KAFKA__CONSUMER__SECURITY_PROTOCOL", "ssl")
    monkeypatch.setenv("WORKER__KAFKA__CONSUMER__SSL_CA_LOCATION",
                       str(tmp_path / "mounted-in-the-pod" / "ca.crt"))
    assert main(["check-config", "--config", _config(tmp_path)]) == 0
    err = capsys.readouterr().err
    assert (
        f"note: $.kafka.consumer.ssl.ca.location: {tmp_path}/mounted-in-the-pod/ca.crt is not on this "
        "machine (set by WORKER__KAFKA__CONSUMER__SSL_CA_LOCATION) (not checked; `worker "
        "run` here would exit 2)"
        in err
    )
    assert main(["run", "--config", _config(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        "config error: $.kafka.consumer.ssl.ca.location: no such file on this machine: "
        f"{tmp_path}/mounted-in-the-pod/ca.crt (set by WORKER__KAFKA__CONSUMER__SSL_CA_LOCATION)\n")
    # librdkafka's own lookup: checked
    monkeypatch.setenv("WORKER__KAFKA__CONSUMER__SSL_CA_LOCATION", "probe")
    assert main(["check-config", "--config", _config(tmp_path)]) == 0
    assert "note:" not in capsys.readouterr().err
