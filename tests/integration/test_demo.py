"""``worker demo`` (what ``make demo`` runs), as a user runs it, against the session's broker: every request
gets its ok result, the two malformed ones their dead letters, and the summary says so."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.kafka_io import ROOT

pytestmark = pytest.mark.integration


def test_demo_summary_accounts_for_every_request(kafka):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("KAFKA_BOOTSTRAP_SERVERS", None)
    # --warm-up-s: the warm-up a freshly started local broker gets, here through the session's broker.
    p = subprocess.run([sys.executable, "-m", "worker", "demo", "--records", "400", "--rate", "1000",
                        "--bootstrap", kafka.bootstrap, "--warm-up-s", "0.5"], capture_output=True, text=True,
                       timeout=300, env=env,
                       cwd=str(ROOT))
    out = p.stdout + p.stderr
    print(out[-1500:])
    assert p.returncode == 0, out[-3000:]
    assert "distinct ok ids   400 of 400" in out
    assert "results out       401 (400 ok, 1 error)" in out  # the invalid request with a readable id
    assert "dead letters      2" in out
    assert "warming up the broker (0.5 s" in out


def test_demo_reports_a_worker_that_fails_to_start_at_once(kafka, monkeypatch, capsys):
    import time

    import worker.models.registry
    from worker.app.cli import main
    from worker.config.settings import ConfigError

    def broken(cfg):
        raise ConfigError("$.model.name: 'minilm' needs the models extra (in this test: on purpose)")

    monkeypatch.setattr(worker.models.registry, "load_model", broken)  # the model, not the broker
    t0 = time.monotonic()
    rc = main(["demo", "--records", "10", "--bootstrap", kafka.bootstrap, "--warm-up-s", "0"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "config error: $.model.name: 'minilm' needs the models extra" in err
    assert time.monotonic() - t0 < 60  # not the 300 s start-up timeout


def test_an_interrupted_demo_stops_its_worker_before_returning(kafka, monkeypatch):
    import threading

    import worker.app.demo
    from worker.app.cli import main

    def interrupted(*_args, **_kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(worker.app.demo, "_collect", interrupted)  # Ctrl-C while the demo waits for results
    assert main(["demo", "--records", "10", "--bootstrap", kafka.bootstrap, "--warm-up-s", "0"]) == 130
    # Stopped and joined: with a broker of the demo's own, it is closed only after this.
    assert [t for t in threading.enumerate() if t.name == "worker-loop"] == []
