"""``worker demo`` with its own freshly started broker (``make demo`` as a newcomer runs it): the console
shows the demo's lines and nothing raw from librdkafka (``%4|...|GETPID|... Coordinator load in progress``,
which a fresh broker makes the idempotent producers log) or from other libraries at exit."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests.support import needs
from tests.support.kafka_io import ROOT

pytestmark = pytest.mark.integration


def test_the_demo_console_has_no_raw_third_party_lines() -> None:
    needs.command("java")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("KAFKA_BOOTSTRAP_SERVERS", None)
    p = subprocess.run([sys.executable, "-m", "worker", "demo", "--records", "300", "--rate", "1000"],
                       capture_output=True, text=True, timeout=600, env=env, cwd=str(ROOT))
    out = p.stdout + p.stderr
    assert p.returncode == 0, out[-3000:]
    assert "distinct ok ids   300 of 300" in out
    raw = [line for line in out.splitlines() if re.match(r"%\d\|", line) or "nanobind" in line]
    assert raw == [], raw[:10]
    # librdkafka's lines, when any reach the console, come through the worker's logging ("LEVEL logger:
    # text").
    assert not [line for line in p.stderr.splitlines() if "|GETPID|" in line or "|FAIL|" in line]
