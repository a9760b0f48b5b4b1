from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from worker.config import ConfigError, from_dict, load, redact

ROOT = Path(__file__).resolve().parents[2]
BASE = {"kafka": {"input_topics": ["in"]}}


def test_defaults_are_valid():
    cfg = from_dict(BASE, environ={})
    assert cfg.kafka.output_topic == "inference-results"
    assert cfg.batching.lanes[0].name == "default"
    assert cfg.lane_topics() == {"in": "default"}


@pytest.mark.parametrize("data, path", [
    ({"kafka": {"input_topics": ["in"], "bogus": 1}}, "$.kafka.bogus: unknown key"),
    ({**BASE, "batching": {"lanes": [{"name": "a", "max_wait_ms": -1}]}, }, "$.batching.lanes[0].max_wait_ms"),
    ({**BASE, "batching": {"lanes": [{"name": "a", "max_batch_size": "x"}]}}, "$.batching.lanes[0].max_batch_size"),
    ({**BASE, "delivery": {"mode": "twice"}}, "$.delivery.mode"),
    ({**BASE, "metrics": {"port": 70000}}, "$.metrics.port"),
    ({**BASE, "topsecret": {}}, "$.topsecret: unknown key"),
])
def test_errors_name_the_key_path(data, path):
    with pytest.raises(ConfigError) as e:
        from_dict(data, environ={})
    assert path in str(e.value)


def test_bad_value_message_says_what_was_expected():
    with pytest.raises(ConfigError) as e:
        from_dict({**BASE, "batching": {"lanes": [{"name": "a", "max_batch_size": 0}]}}, environ={})
    assert "$.batching.lanes[0].max_batch_size" in str(e.value) and ">= 1" in str(e.value)


def test_semantic_errors():
    with pytest.raises(ConfigError, match=r"\$.batching.default_lane"):
        from_dict({**BASE, "batching": {"default_lane": "nope"}}, environ={})
    with pytest.raises(ConfigError, match=r"\$.kafka.input_topics"):
        from_dict({}, environ={})
    with pytest.raises(ConfigError, match=r"enable.auto.commit"):
        from_dict({"kafka": {"input_topics": ["in"], "consumer": {"enable.auto.commit": True}}}, environ={})
    with pytest.raises(ConfigError, match=r"duplicate lane"):
        from_dict({**BASE, "batching": {"lanes": [{"name": "a"}, {"name": "a"}], "default_lane": "a"}}, environ={})


def test_env_overrides_sections_lists_and_passthrough():
    env = {
        "WORKER__KAFKA__GROUP_ID": "g2",
        "WORKER__BATCHING__LANES__0__MAX_WAIT_MS": "7.5",
        "WORKER__KAFKA__CONSUMER__SESSION_TIMEOUT_MS": "10000",
        "WORKER__MODEL__WARMUP": "false",
        "UNRELATED": "x",
    }
    cfg = from_dict(BASE, environ=env)
    assert cfg.kafka.group_id == "g2"
    assert cfg.batching.lanes[0].max_wait_ms == 7.5
    assert cfg.kafka.consumer["session.timeout.ms"] == 10000
    assert cfg.model.warmup is False


def test_env_override_bad_value_names_path():
    with pytest.raises(ConfigError, match=r"\$.delivery.max_attempts"):
        from_dict(BASE, environ={"WORKER__DELIVERY__MAX_ATTEMPTS": "many"})


def test_secret_references(tmp_path, monkeypatch):
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    monkeypatch.setenv("SASL_PW", "envpw")
    cfg = from_dict({"kafka": {"input_topics": ["in"], "consumer": {
        "sasl.password": "${env:SASL_PW}", "ssl.key.password": f"${{file:{secret}}}"}}}, environ={})
    assert cfg.kafka.consumer["sasl.password"] == "envpw"
    assert cfg.kafka.consumer["ssl.key.password"] == "s3cret"
    assert redact(dict(cfg.kafka.consumer))["sasl.password"] == "***"
    with pytest.raises(ConfigError, match=r"\$.redis.password: environment variable 'NOPE_X'"):
        from_dict({**BASE, "redis": {"password": "${env:NOPE_X}"}}, environ={})


def test_load_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config file"):
        load(tmp_path / "missing.yaml", environ={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("kafka: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load(bad, environ={})


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os
    return subprocess.run([sys.executable, "-m", "worker", *args], capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}, timeout=120)


def test_check_config_cli_exit_codes(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("kafka:\n  input_topics: [requests]\n")
    r = _cli("check-config", "--config", str(good))
    assert r.returncode == 0, r.stderr
    assert "OK" in r.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text("kafka:\n  input_topics: [requests]\nbatching:\n  lanes:\n    - name: a\n      max_wait_ms: oops\n")
    r = _cli("check-config", "--config", str(bad))
    assert r.returncode == 2
    assert "$.batching.lanes[0].max_wait_ms" in r.stderr
    r = _cli("check-config", "--config", str(good), env={"WORKER__KAFKA__NOPE": "1"})
    assert r.returncode == 2 and "$.kafka.nope: unknown key" in r.stderr


def test_cli_help_and_usage_errors():
    r = _cli("--help")
    assert r.returncode == 0 and "run" in r.stdout and "backfill" in r.stdout
    r = _cli("run")
    assert r.returncode == 2 and "--config" in r.stderr
