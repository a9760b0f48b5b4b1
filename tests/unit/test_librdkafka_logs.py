"""librdkafka's own log lines go through the worker's logging, and a process ends without third-party
noise."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from worker.observability.logs import LibrdkafkaLog

ROOT = Path(__file__).resolve().parents[2]

# A client of an address nothing listens on: librdkafka logs "Connect to ... failed" (FAIL, level 3) at once.
CLIENT = """
import sys
from worker.kafka.clients import consumer_config, producer_config
from worker.config.settings import from_dict
from worker.observability.logs import setup_logging
from confluent_kafka import Consumer, Producer

setup_logging("INFO", "json")
cfg = from_dict({"kafka": {"input_topics": ["in"], "bootstrap_servers": "127.0.0.1:1"}}, environ={})
conf = consumer_config(cfg)
if sys.argv[1] == "raw":
    del conf["logger"]
c = Consumer(conf)
c.subscribe(["in"])
c.poll(1.5)
c.close()
"""


def _client(mode: str) -> list[str]:
    p = subprocess.run([sys.executable, "-c", CLIENT, mode], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": str(ROOT)},
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    return p.stderr.splitlines()


def test_librdkafka_lines_are_json_log_records_with_their_fields() -> None:
    lines = _client("logged")
    assert lines, "librdkafka logged nothing about the refused connection"
    records = [json.loads(line) for line in lines]  # every line: one of the worker's JSON records, none raw
    fail = next(r for r in records if r.get("facility") == "FAIL")
    assert fail["level"] == "ERROR" and fail["logger"] == "worker.kafka.consumer"
    assert fail["client"].endswith("#consumer-1")
    assert fail["msg"].startswith("127.0.0.1:1/bootstrap: Connect to ipv4#127.0.0.1:1 "
                                  "failed: Connection refused")
    assert fail["rdkafka_thread"] == "127.0.0.1:1/bootstrap"


def test_without_the_logger_librdkafka_writes_raw_lines() -> None:
    """The control: what the worker's clients would print without their ``logger`` property."""
    assert any(line.startswith("%3|") and "|FAIL|" in line for line in _client("raw"))


def test_levels_follow_librdkafka_and_transient_coordinator_loads_are_info(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = LibrdkafkaLog("worker.kafka.test")
    with caplog.at_level(logging.DEBUG, logger="worker.kafka.test"):
        log.log(30, "%s [%s] %s", "GETPID", "rdkafka#producer-1",
                "[thrd:main]: Failed to acquire transactional PID from broker TxnCoordinator/1: Broker: "
                "Coordinator load in progress: retrying")
        log.log(30, "%s [%s] %s", "CONFWARN", "rdkafka#producer-1", "[thrd:app]: Configuration property "
                "x is deprecated")
        log.log(10, "%s [%s] %s", "BROKER", "rdkafka#producer-1", "no thread prefix")
        log.log(20, "plain %s", "message")
    got = [(r.levelname, getattr(r, "facility", None), r.getMessage()) for r in caplog.records]
    assert got == [
        ("INFO", "GETPID", "Failed to acquire transactional PID from broker TxnCoordinator/1: Broker: "
                           "Coordinator load in progress: retrying"),
        ("WARNING", "CONFWARN", "Configuration property x is deprecated"),
        ("DEBUG", "BROKER", "no thread prefix"),
        ("INFO", None, "plain message"),
    ]


def test_worker_run_with_minilm_ends_without_third_party_noise(tmp_path: Path) -> None:
    """``worker run`` with minilm, stopped with SIGTERM: every stderr line is one of the worker's JSON
    records. (transformers' BERT imports torch._dynamo, which imports triton, whose nanobind extension reports
    each of its objects still alive at exit: those the runner's gc.freeze() keeps from being collected, unless
    the CLI unfreezes them.)"""
    cfg = tmp_path / "worker.yaml"
    cfg.write_text(textwrap.dedent("""\
        kafka: {input_topics: [in], bootstrap_servers: "127.0.0.1:1"}
        model: {name: minilm, device: cpu}
        metrics: {enabled: false}
        logging: {level: INFO, format: json}
        """))
    err = tmp_path / "stderr"
    with err.open("w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "worker", "run", "--config", str(cfg)], cwd=tmp_path,
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                                stderr=f)
    try:
        deadline = time.monotonic() + 240
        while '"msg": "worker started"' not in err.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, err.read_text()
            time.sleep(0.5)
        assert '"msg": "worker started"' in err.read_text()
        proc.send_signal(signal.SIGTERM)
        rc = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = err.read_text().splitlines()
    assert rc == 0, lines[-20:]
    raw = [line for line in lines if not line.startswith("{")]
    assert raw == [], raw[:20]
    assert '"msg": "shutting down"' in "\n".join(lines)
