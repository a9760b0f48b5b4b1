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
                        "--bootstrap", kafka.bootstrap, "--warm-up-s", "0.5"], capture_output=True, text=True, timeout=300, env=env,
                       cwd=str(ROOT))
    out = p.stdout + p.stderr
    print(out[-1500:])
    assert p.returncode == 0, out[-3000:]
    assert "distinct ok ids   400 of 400" in out
    assert "results out       401 (400 ok, 1 error)" in out  # the invalid request with a readable id
    assert "dead letters      2" in out
    assert "warming up the broker (0.5 s" in out
