from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from worker.config.settings import ConfigError, from_dict, load, name_overrides, redact

ROOT = Path(__file__).resolve().parents[2]
BASE = {"kafka": {"input_topics": ["in"]}}


def test_defaults_are_valid():
    cfg = from_dict(BASE, environ={})
    assert cfg.kafka.output_topic == "inference-results"
    assert cfg.batching.lanes[0].name == "default"
    assert cfg.lane_topics() == {"in": "default"}


@pytest.mark.parametrize("data, path", [
    ({"kafka": {"input_topics": ["in"], "bogus": 1}}, "$.kafka.bogus: unknown key"),
    ({**BASE, "batching": {"lanes": [{"name": "a", "max_wait_ms": -1}]}, },
     "$.batching.lanes[0].max_wait_ms"),
    ({**BASE, "batching": {"lanes": [{"name": "a", "max_batch_size": "x"}]}},
     "$.batching.lanes[0].max_batch_size"),
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
        from_dict({**BASE, "batching": {"lanes": [{"name": "a"}, {"name": "a"}], "default_lane": "a"}},
                  environ={})


@pytest.mark.parametrize("kafka, message", [
    ({"input_topics": ["in"], "dlq_topic": "in"}, r"\$.kafka.dlq_topic: must differ from the input topics"),
    ({"dlq_topic": "hi-topic"}, r"\$.kafka.dlq_topic: must differ from the input topics"),
    ({"input_topics": ["in"], "dlq_topic": "out", "output_topic": "out"},
     r"\$.kafka.dlq_topic: must differ from kafka.output_topic"),
    ({"input_topics": ["in"], "output_topic": "hi-topic"},
     r"\$.kafka.output_topic: must differ from the input"),
])
def test_output_and_dead_letter_topics_must_not_feed_the_inputs(kafka, message):
    lanes = {"lanes": [{"name": "default"}, {"name": "hi", "topics": ["hi-topic"]}]}
    with pytest.raises(ConfigError, match=message):
        from_dict({"kafka": kafka, "batching": lanes}, environ={})


def test_librdkafka_property_errors_name_the_property():
    for value, got in ((None, "nothing"), ([1], "a list"), ({"a": 1}, "a dict")):
        with pytest.raises(ConfigError, match=rf"^\$.kafka.producer.sasl.password: .* got {got}"):
            from_dict({"kafka": {"input_topics": ["in"], "producer": {"sasl.password": value}}}, environ={})


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
    assert cfg.kafka.consumer["session.timeout.ms"] == "10000"  # text: librdkafka parses it
    assert cfg.model.warmup is False


def test_env_override_bad_value_names_path_and_variable():
    with pytest.raises(ConfigError, match=r"^\$.delivery.max_attempts: .*\(set by "
                                          r"WORKER__DELIVERY__MAX_ATTEMPTS\)$"):
        from_dict(BASE, environ={"WORKER__DELIVERY__MAX_ATTEMPTS": "many"})
    with pytest.raises(ConfigError, match=r"^\$.kafka.groupid: unknown key; did you mean `group_id`\? \(set "
                                          r"by WORKER__KAFKA__GROUPID\)$"):
        from_dict(BASE, environ={"WORKER__KAFKA__GROUPID": "g"})
    # Not YAML: a clear error naming the variable, never a traceback (the CLI exits 2 on ConfigError).
    with pytest.raises(ConfigError, match=r"^\$.batching.lanes\[0\].topics \(from "
                                          r"WORKER__BATCHING__LANES__0__TOPICS\): not a valid YAML value"):
        from_dict(BASE, environ={"WORKER__BATCHING__LANES__0__TOPICS": "[a, b"})


def test_env_override_of_a_text_key_keeps_the_text_as_written():
    # YAML would read these as an int, a date, a bool and a list: the keys take text, so the text stands.
    cfg = from_dict(BASE, environ={"WORKER__KAFKA__GROUP_ID": "123", "WORKER__MODEL__VERSION": "2024-06-01",
                                   "WORKER__REDIS__PASSWORD": "yes", "WORKER__KAFKA__DLQ_TOPIC": "[dlq"})
    assert (cfg.kafka.group_id, cfg.model.version, cfg.redis.password, cfg.kafka.dlq_topic) == (
        "123", "2024-06-01", "yes", "[dlq")
    # Numbers, booleans and lists still parse where the key takes them.
    cfg = from_dict(BASE, environ={"WORKER__METRICS__PORT": "9500", "WORKER__KAFKA__INPUT_TOPICS": "[a, b]",
                                   "WORKER__MODEL__OPTIONS__HIDDEN": "8"})
    assert (cfg.metrics.port, cfg.kafka.input_topics, cfg.model.options["hidden"]) == (9500, ["a", "b"], 8)


@pytest.mark.parametrize("raw", ["0123", "12:30", "1_000", "on", "0x1F", "1.50", "null", "[a]", "'q'"])
def test_env_override_of_a_librdkafka_property_keeps_the_text_as_written(raw):
    """Read as YAML, the password 0123 was 83, 12:30 was 750, on was true: librdkafka parses the text
    itself."""
    env = {"WORKER__KAFKA__CONSUMER__SASL_PASSWORD": raw, "WORKER__KAFKA__PRODUCER__SASL_PASSWORD": raw}
    cfg = from_dict(BASE, environ=env)
    assert cfg.kafka.consumer["sasl.password"] == cfg.kafka.producer["sasl.password"] == raw
    # A whole section from one variable is still YAML (a mapping).
    cfg = from_dict(BASE, environ={"WORKER__KAFKA__CONSUMER": "{fetch.min.bytes: 10}"})
    assert cfg.kafka.consumer == {"fetch.min.bytes": 10}


def test_a_repeated_key_in_the_file_is_an_error(tmp_path):
    f = tmp_path / "dup.yaml"
    f.write_text("kafka:\n  input_topics: [in]\nbatching:\n  lanes: [{name: hi}, {name: default}]\n"
                 "batching:\n  max_in_flight: 100\n")
    with pytest.raises(ConfigError, match=r"dup.yaml: line 5: duplicate key \$.batching \(first on line 3\)"):
        load(f, environ={})
    f.write_text("kafka:\n  input_topics: [in]\n  consumer: {a.b: 1, a.b: 2}\n")
    with pytest.raises(ConfigError, match=r"duplicate key \$.kafka.consumer.a.b "):
        load(f, environ={})
    # A YAML merge ("<<: *anchor") is not a repeat: an explicit key overrides the merged one.
    f.write_text("kafka:\n  input_topics: [in]\n  consumer: &props {client.id: a, linger.ms: 1}\n"
                 "  producer:\n    <<: *props\n    client.id: b\n")
    assert load(f, environ={}).kafka.producer == {"client.id": "b", "linger.ms": 1}


def test_secret_references(tmp_path, monkeypatch):
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    # ${env:...} reads the same environment as the WORKER__ overrides: the one passed in, not os.environ.
    monkeypatch.setenv("SASL_PW", "not-this-one")
    cfg = from_dict({"kafka": {"input_topics": ["in"], "consumer": {
        "sasl.password": "${env:SASL_PW}", "ssl.key.password": f"${{file:{secret}}}"}}},
                    environ={"SASL_PW": "envpw"})
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


def test_a_file_that_is_not_utf8_is_a_config_error(tmp_path):
    """A UnicodeDecodeError escaped with a traceback (exit 1) for the config file and for a ${file:...}
    secret."""
    f = tmp_path / "latin1.yaml"
    f.write_bytes("kafka:\n  group_id: café\n  input_topics: [in]\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"^cannot read config file '.*latin1.yaml': not UTF-8 \(line 2, "
                                          r"byte offset 22\)"):
        load(f, environ={})
    secret = tmp_path / "pw"
    secret.write_bytes(b"\xffs3cret")
    with pytest.raises(ConfigError) as e:
        from_dict({**BASE, "redis": {"password": f"${{file:{secret}}}"}}, environ={})
    assert str(e.value).startswith(f"$.redis.password: cannot read secret file '{secret}': "
                                   "not UTF-8 (line 1, byte")
    assert "s3cret" not in str(e.value) and "xff" not in str(e.value)
    # A byte order mark (Windows editors write one) is no part of the secret.
    secret.write_bytes(b"\xef\xbb\xbfs3cret\n")
    assert from_dict({**BASE, "redis": {"password": f"${{file:{secret}}}"}},
                     environ={}).redis.password == "s3cret"
    r = _cli("check-config", "--config", str(f))
    assert r.returncode == 2 and "not UTF-8" in r.stderr and "Traceback" not in r.stderr


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
    bad.write_text("kafka:\n  input_topics: [requests]\nbatching:\n  lanes:\n    - name: a\n      "
                   "max_wait_ms: oops\n")
    r = _cli("check-config", "--config", str(bad))
    assert r.returncode == 2
    assert "$.batching.lanes[0].max_wait_ms" in r.stderr
    r = _cli("check-config", "--config", str(good), env={"WORKER__KAFKA__NOPE": "1"})
    assert r.returncode == 2 and "$.kafka.nope: unknown key" in r.stderr
    r = _cli("check-config", "--config", str(good), env={"WORKER__KAFKA__INPUT_TOPICS": "[a"})
    assert r.returncode == 2 and "WORKER__KAFKA__INPUT_TOPICS" in r.stderr and "Traceback" not in r.stderr
    # librdkafka would refuse it when `worker run` makes its consumer, after the model load, with a traceback.
    r = _cli("check-config", "--config", str(good),
             env={"WORKER__KAFKA__CONSUMER__SESION_TIMEOUT_MS": "10000"})
    assert r.returncode == 2 and r.stderr.strip() == (
        'config error: $.kafka.consumer.sesion.timeout.ms: librdkafka refuses it: No such configuration '
        'property: "sesion.timeout.ms" (set by WORKER__KAFKA__CONSUMER__SESION_TIMEOUT_MS)'), r.stderr


@pytest.mark.parametrize("model, message", [
    ("{name: tinyy}", "$.model.name: unknown model 'tinyy'"),
    ("{name: tiny, options: {hiden: 3}}", "$.model.options.hiden: unknown option"),
    ("{name: /nonexistent/model.pt}", "$.model.name: file '/nonexistent/model.pt' not found"),
    ("{name: 'no_such_module_kiw:build'}", "$.model.name: cannot import 'no_such_module_kiw'"),
])
def test_check_config_checks_the_model_name_and_options(tmp_path, model, message):
    f = tmp_path / "c.yaml"
    f.write_text(f"kafka:\n  input_topics: [requests]\nmodel: {model}\n")
    r = _cli("check-config", "--config", str(f))
    assert r.returncode == 2 and message in r.stderr, r.stderr


def test_check_config_reports_how_the_model_resolved(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("kafka:\n  input_topics: [requests]\nmodel: {name: tiny, options: {hidden: 8}}\n")
    r = _cli("check-config", "--config", str(f))
    assert r.returncode == 0 and "model 'tiny' (built-in)" in r.stdout, r.stderr


def test_cli_help_and_usage_errors():
    r = _cli("--help")
    assert r.returncode == 0 and "run" in r.stdout and "backfill" in r.stdout
    r = _cli("run")
    assert r.returncode == 2 and "--config" in r.stderr


@pytest.mark.parametrize("env, message", [
    ({"WORKER__KAFKAX__FOO": "1"}, r"^\$.kafkax: unknown key; did you mean `kafka`\? \(set by "
                                   r"WORKER__KAFKAX__FOO\)$"),
    ({"WORKER__MODEL__DEVICE": "gpu"}, r"^\$.model.device: expected .* got 'gpu' \(set by "
                                       r"WORKER__MODEL__DEVICE\)$"),
    ({"WORKER__KAFKA__OUTPUT_TOPIC": "in"},
     r"^\$.kafka.output_topic: must differ .* \(set by WORKER__KAFKA__OUTPUT_TOPIC\)$"),
    ({"WORKER__BATCHING__LANES__1__NAME": "default"},  # a check on a section names what was set under it
     r"^\$.batching.lanes: duplicate lane names \['default'\] \(set by WORKER__BATCHING__LANES__1__NAME\)$"),
    ({"WORKER__REDIS__PASSWORD": "${env:NOPE_X}"},
     r"^\$.redis.password: environment variable 'NOPE_X' is not set \(set by WORKER__REDIS__PASSWORD\)$"),
])
def test_every_error_about_an_overridden_key_names_the_variable(env, message):
    data = {**BASE, "batching": {"lanes": [{"name": "default"}, {"name": "hi"}]}}
    with pytest.raises(ConfigError, match=message):
        from_dict(data, environ=env)


def test_a_type_error_does_not_blame_a_variable_set_elsewhere_in_the_section():
    # The file's lane lacks its name; the variable only set its max_wait_ms.
    with pytest.raises(ConfigError) as e:
        from_dict({**BASE, "batching": {"lanes": [{"max_wait_ms": 1}]}},
                  environ={"WORKER__BATCHING__LANES__0__MAX_WAIT_MS": "5"})
    assert "$.batching.lanes[0]" in str(e.value) and "set by" not in str(e.value)


@pytest.mark.parametrize("value", [True, 1, "1", "t", "T", "TRUE", " true ", "yes"])
def test_auto_commit_is_rejected_in_every_spelling_of_true(value):
    for key in ("enable.auto.commit", "enable.auto.offset.store"):
        with pytest.raises(ConfigError, match=rf"^\$.kafka.consumer.{key}: must stay false"):
            from_dict({"kafka": {"input_topics": ["in"], "consumer": {key: value}}}, environ={})


@pytest.mark.parametrize("value", [False, 0, "0", "f", "false", "FALSE"])
def test_auto_commit_may_be_spelled_false(value):
    cfg = from_dict({"kafka": {"input_topics": ["in"], "consumer": {"enable.auto.commit": value}}},
                    environ={})
    assert cfg.kafka.consumer["enable.auto.commit"] == value


@pytest.mark.parametrize("url, ok", [
    ("redis://h:6379/0", True), ("rediss://:pw@h:6380/0", True), ("unix:///run/redis.sock", True),
    ("REDIS://h", False), ("http://x", False), ("h:6379", False), ("ftp://u:pw@h", False),
])
def test_redis_url_scheme_is_checked(url, ok):
    data = {**BASE, "redis": {"url": url}}
    if ok:
        assert from_dict(data, environ={}).redis.url == url
        return
    with pytest.raises(ConfigError, match=r"^\$.redis.url: expected redis://") as e:
        from_dict(data, environ={})
    assert "pw" not in str(e.value)  # the URL's password is not echoed


@pytest.mark.parametrize("url, message", [
    ("redis://redis:6379x/0", "the port must be a number from 0 to 65535, got '6379x'"),
    ("redis://redis:99999/0", "the port must be a number from 0 to 65535, got '99999'"),
    ("redis://redis:6379/0?socket_connect_timeout=abc",
     "invalid value for the query option 'socket_connect_timeout', got 'abc'"),
    ("unix:///run/redis.sock?db=one", "invalid value for the query option 'db', got 'one'"),
    ("redis://redis:6379/zero", "the path after host:port must be a database number (/0, "
                                "/1, ...), got '/zero'"),
    ("redis://redis:6379/0?sockettimeout=1", "unknown query option 'sockettimeout'"),
    ("redis://redis:6379/0?socket_timeout=30", "the query option 'socket_timeout' is set from "
                                               "redis.timeout_ms"),
    ("redis://[::1:6379/0", "not a valid URL"),
])
def test_a_redis_url_redis_py_would_reject_is_a_config_error(url, message):
    """redis-py reads the URL only when the store first connects (the worker's first record), and its
    ValueError named no key: check-config passed and the worker crashed."""
    with pytest.raises(ConfigError) as e:
        from_dict({**BASE, "redis": {"url": url}}, environ={})
    assert str(e.value).startswith(f"$.redis.url: {message}")
    with pytest.raises(ConfigError) as e:
        from_dict(BASE, environ={"WORKER__REDIS__URL": url})
    assert str(e.value).startswith(f"$.redis.url: {message}") and str(e.value).endswith(
        "(set by WORKER__REDIS__URL)")


@pytest.mark.parametrize("url", ["redis://:s3cr3t@redis:6379x/0", "redis://:s3cr3t/x@redis:6379/0",
                                 "redis://user:s3cr3t@redis:6379/zero",
                                 "redis://redis/0?password=s3cr3t&db=x"])
def test_a_bad_redis_url_error_does_not_echo_its_password(url):
    with pytest.raises(ConfigError) as e:
        from_dict({**BASE, "redis": {"url": url}}, environ={})
    assert str(e.value).startswith("$.redis.url: ") and "s3cr3t" not in str(e.value)


@pytest.mark.parametrize("url", ["redis://redis:6379/0", "redis://redis", "redis://u:p@redis:6379/3?db=2",
                                 "rediss://redis:6380/0?ssl_cert_reqs=required",
                                 "unix:///run/redis.sock?db=1"])
def test_good_redis_urls_pass(url):
    assert from_dict({**BASE, "redis": {"url": url}}, environ={}).redis.url == url


def test_a_tls_ca_file_without_tls_is_refused():
    """The store refused it when the worker started: run exited 1 with a traceback after the model load."""
    with pytest.raises(ConfigError,
                       match=r"^\$\.redis\.tls_ca_file: set but TLS is off: set redis\.tls: true"):
        from_dict({**BASE, "redis": {"url": "redis://redis:6379/0", "tls_ca_file": "/ca.pem"}}, environ={})
    for redis in ({"url": "redis://redis:6379/0", "tls": True}, {"url": "rediss://redis:6380/0"}):
        assert from_dict({**BASE, "redis": {**redis, "tls_ca_file": "/ca.pem"}}, environ={}).redis.tls_ca_file


def test_max_attempts_1_is_refused_with_redis():
    """With the attempt counters on, 1 dead-letters every record that was on a device when a process
    stopped."""
    with pytest.raises(ConfigError, match=r"^\$.delivery.max_attempts: must be >= 2 with redis.url set"):
        from_dict({**BASE, "redis": {"url": "redis://redis:6379/0"}, "delivery": {"max_attempts": 1}},
                  environ={})
    # no counters
    assert from_dict({**BASE, "delivery": {"max_attempts": 1}}, environ={}).delivery.max_attempts == 1


def test_a_repeated_key_next_to_a_cyclic_alias_is_still_a_config_error(tmp_path):
    # Naming the key walked the node graph recursively: a self-referencing alias raised RecursionError.
    f = tmp_path / "cyc.yaml"
    f.write_text("kafka:\n  input_topics: [in]\n  consumer: &x {self: *x}\nmodel:\n  name: tiny\n "
                 " name: tiny\n")
    with pytest.raises(ConfigError, match=r"duplicate key \$.model.name"):
        load(f, environ={})


def test_a_repeated_key_is_named_by_its_path(tmp_path):
    f = tmp_path / "dup.yaml"
    f.write_text("kafka:\n  input_topics: [in]\nbatching:\n  lanes:\n    - name: a\n      max_wait_ms: 1\n"
                 "      max_wait_ms: 2\n  default_lane: a\n")
    with pytest.raises(ConfigError, match=r"dup.yaml: line 7: duplicate key "
                                          r"\$.batching.lanes\[0\].max_wait_ms \(first on line 6\)"):
        load(f, environ={})


def test_a_yaml_syntax_error_names_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("kafka:\n  input_topics: [unclosed\n")
    with pytest.raises(ConfigError) as e:
        load(bad, environ={})
    assert f'in "{bad}", line 2' in str(e.value) and "<unicode string>" not in str(e.value)


def test_config_reprs_hide_secrets():
    cfg = from_dict({"kafka": {"input_topics": ["in"], "consumer": {"sasl.password": "kpw",
                                                                    "sasl.username": "u"}},
                     "redis": {"url": "redis://:upw@h:6379/0", "password": "rpw"},
                     "model": {"options": {"api_token": "tpw"}}}, environ={})
    for text in (repr(cfg.redis), repr(cfg.kafka), repr(cfg)):
        assert not any(s in text for s in ("kpw", "upw", "rpw", "tpw")), text
    assert "password='***'" in repr(cfg.redis) and "redis://:***@h:6379/0" in repr(cfg.redis)
    assert "'sasl.username': 'u'" in repr(cfg.kafka)  # what is not secret stays readable
    assert repr(from_dict(BASE, environ={}).redis).startswith("RedisConfig(url=None, password=None,")


def test_redact_config_masks_secret_keys_at_any_depth_and_url_passwords():
    from worker.config.settings import redact_config

    data = {"kafka": {"consumer": {"sasl.password": "p", "ssl.key.password": "p",
                                   "sasl.mechanisms": "PLAIN"}},
            "redis": {"url": "rediss://user:p@h:6380/0", "password": "p"}, "lanes": [{"client_secret": "p"}],
            "empty": {"password": ""}, "unset": {"password": None}}
    assert redact_config(data) == {
        "kafka": {"consumer": {"sasl.password": "***", "ssl.key.password": "***",
                               "sasl.mechanisms": "PLAIN"}},
        "redis": {"url": "rediss://user:***@h:6380/0", "password": "***"},
        "lanes": [{"client_secret": "***"}],
        "empty": {"password": ""}, "unset": {"password": None}}
    # Any separator, secrets in sasl.oauthbearer.config, and a password passed in a URL's query.
    tricky = {"kafka": {"consumer": {"sasl.oauthbearer.config": "clientId=a clientSecret=b"}},
              "model": {"options": {"x-api-key": "k", "API.KEY": "k", "ssl.key.pem": "-----BEGIN"}},
              "redis": {"url": "redis://h:6379/0?password=s3cr3t&db=1"}}
    assert redact_config(tricky) == {
        "kafka": {"consumer": {"sasl.oauthbearer.config": "***"}},
        "model": {"options": {"x-api-key": "***", "API.KEY": "***", "ssl.key.pem": "***"}},
        "redis": {"url": "redis://h:6379/0?password=***&db=1"}}


def test_check_config_print_shows_no_resolved_secret(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("kafka:\n  input_topics: [requests]\n  consumer: {sasl.password: '${env:KIW_T_PW}'}\n"
                 "redis:\n  url: 'redis://:${env:KIW_T_PW}@h:6379/0'\n  password: '${env:KIW_T_PW}'\n")
    r = _cli("check-config", "--config", str(f), "--print", env={"KIW_T_PW": "s3cr3t-value"})
    assert r.returncode == 0, r.stderr
    assert "s3cr3t-value" not in r.stdout
    assert "sasl.password: '***'" in r.stdout and "redis://:***@h:6379/0" in r.stdout


@pytest.mark.parametrize("lane_key", ["deadline_ms", "max_wait_ms", "weight"])
def test_an_infinite_number_is_refused_with_its_path(lane_key: str) -> None:
    """``.inf`` passed the "> 0" checks; a lane deadline of .inf then crashed the adaptive scheduler's fill
    (an OverflowError at dispatch, exit 1 at every restart)."""
    data = {"kafka": {"input_topics": ["t"]},
            "batching": {"lanes": [{"name": "default", lane_key: float("inf")}]}}
    with pytest.raises(ConfigError, match=rf"\$\.batching\.lanes\[0\]\.{lane_key}: must be a finite number"):
        from_dict(data, environ={})
    with pytest.raises(ConfigError, match=r"WORKER__MODEL__BATCH_TIMEOUT_S"):
        from_dict({"kafka": {"input_topics": ["t"]}}, environ={"WORKER__MODEL__BATCH_TIMEOUT_S": ".inf"})


def test_rejoin_timeout_defaults_to_the_rebalance_timeout_plus_a_session_timeout():
    assert from_dict(BASE, environ={}).kafka.rejoin_timeout_s() == 345.0  # librdkafka: 300 s + 45 s
    cfg = from_dict({"kafka": {**BASE["kafka"], "consumer": {"max.poll.interval.ms": "60000",
                                                             "session.timeout.ms": 10000}}}, environ={})
    assert cfg.kafka.rejoin_timeout_s() == 70.0
    cfg = from_dict(BASE, environ={"WORKER__KAFKA__REJOIN_TIMEOUT_MS": "0"})
    assert cfg.kafka.rejoin_timeout_ms == 0 and cfg.kafka.rejoin_timeout_s() == 0.0
    with pytest.raises(ConfigError, match=r"\$\.kafka\.rejoin_timeout_ms"):
        from_dict({"kafka": {**BASE["kafka"], "rejoin_timeout_ms": -1}}, environ={})


@pytest.mark.parametrize("data, path", [
    # librdkafka: C assertion, exit 134
    ({"kafka": {"input_topics": ["in"], "group_id": ""}}, "$.kafka.group_id"),
    # waits forever
    ({"kafka": {"input_topics": ["in"], "bootstrap_servers": ""}}, "$.kafka.bootstrap_servers"),
    ({"kafka": {"input_topics": ["in", ""]}}, r"$.kafka.input_topics[1]"),
    ({"kafka": {"input_topics": ["in"], "output_topic": ""}}, "$.kafka.output_topic"),
    ({"kafka": {"input_topics": ["in"], "dlq_topic": ""}}, "$.kafka.dlq_topic"),
    ({**BASE, "batching": {"lanes": [{"name": ""}], "default_lane": ""}}, "$.batching.lanes[0].name"),
    ({**BASE, "batching": {"lanes": [{"name": "default", "topics": [""]}]}}, "$.batching.lanes[0].topics[0]"),
])
def test_an_empty_kafka_name_is_refused(data, path):
    with pytest.raises(ConfigError) as e:
        from_dict(data, environ={})
    assert str(e.value) == f"{path}: must not be empty"


def test_an_empty_group_id_from_the_environment_names_the_variable():
    with pytest.raises(ConfigError, match=r"^\$\.kafka\.group_id: must not be empty \(set by "
                                          r"WORKER__KAFKA__GROUP_ID\)$"):
        from_dict(BASE, environ={"WORKER__KAFKA__GROUP_ID": ""})


@pytest.mark.parametrize("kafka, delivery, message", [
    # run overrode it with kafka.group_id; backfill's snapshot used it, reading the live group's commits.
    ({"consumer": {"group.id": "live"}}, {}, r"^\$\.kafka\.consumer\.group\.id: set kafka\.group_id instead"),
    # A transactional producer refuses every record sent outside a transaction (every one in at_least_once).
    ({"producer": {"transactional.id": "t"}}, {}, r"^\$\.kafka\.producer\.transactional\.id: set "
                                                  r"delivery\.transactional_id"),
    ({"producer": {"transactional.id": "t"}}, {"mode": "exactly_once"},
     r"^\$\.kafka\.producer\.transactional\.id"),
    ({"producer": {"acks": 0}}, {}, r"^\$\.kafka\.producer\.acks: must not be 0"),
    ({"producer": {"request.required.acks": "0"}}, {},
     r"^\$\.kafka\.producer\.request\.required\.acks: must not be 0"),
    ({"consumer": {"isolation.level": "read_uncommitted"}}, {"mode": "exactly_once"},
     r"^\$\.kafka\.consumer\.isolation\.level: must stay read_committed with delivery\.mode exactly_once"),
])
def test_a_passthrough_property_that_breaks_the_guarantees_is_refused(kafka, delivery, message):
    with pytest.raises(ConfigError, match=message):
        from_dict({"kafka": {"input_topics": ["in"], **kafka}, "delivery": delivery}, environ={})


def test_passthrough_overrides_that_keep_the_guarantees_are_accepted():
    # at_least_once may read uncommitted input, and trade idempotence for acks=1: duplicates, not loss of
    # commits.
    from_dict({"kafka": {"input_topics": ["in"], "consumer": {"isolation.level": "read_uncommitted"},
                         "producer": {"enable.idempotence": False, "acks": 1}}}, environ={})


def test_a_group_id_in_the_consumer_section_from_the_environment_names_the_variable():
    with pytest.raises(ConfigError, match=r"\(set by WORKER__KAFKA__CONSUMER__GROUP_ID\)$"):
        from_dict(BASE, environ={"WORKER__KAFKA__CONSUMER__GROUP_ID": "other"})


def test_an_error_found_after_loading_names_the_variables_that_set_its_key():
    env = {"WORKER__MODEL__DEVICES": "[cpu, cuda:1]", "WORKER__MODEL__DEVICES__01": "cuda:1",
           "WORKER__KAFKA__CONSUMER__SASL_PASSWORD": "x", "WORKER__MODEL__NAME": "m", "OTHER": "1"}
    assert name_overrides("$.model.devices[1]: no GPU", env) == (
        "$.model.devices[1]: no GPU (set by WORKER__MODEL__DEVICES, WORKER__MODEL__DEVICES__01)")
    assert name_overrides("$.kafka.consumer.sasl.password: bad", env).endswith(
        "(set by WORKER__KAFKA__CONSUMER__SASL_PASSWORD)")
    assert name_overrides("$.model.options: bad", env) == "$.model.options: bad"
    # from_dict's own naming stands.
    assert name_overrides("$.model.name: x (set by WORKER__MODEL__NAME)",
                          env) == "$.model.name: x (set by WORKER__MODEL__NAME)"


def test_poll_max_records_stays_within_what_consume_takes():
    """The runner asks consume() for poll_max_records - 1 records, and consume() raises above 1,000,000."""
    assert from_dict({"kafka": {**BASE["kafka"], "poll_max_records": 1_000_000}}, environ={})
    with pytest.raises(ConfigError, match=r"^\$\.kafka\.poll_max_records: Expected `int` <= 1000000 "
                                          r"\(set by WORKER__KAFKA__POLL_MAX_RECORDS\)$"):
        from_dict(BASE, environ={"WORKER__KAFKA__POLL_MAX_RECORDS": "2000000"})


@pytest.mark.parametrize("text, message", [
    ("kafka:\n  input_topics: [in]\n  1: x\n", "$.kafka: the key 1 is not text but int; in "
                                               "YAML, quote it: '1':"),
    ("kafka: {input_topics: [in]}\nmodel:\n  options: {2024-06-01: x}\n",
     "$.model.options: the key 2024-06-01 is not text but date"),
    # An alias to an anchor around it: a structure without end (RecursionError, exit 1).
    ("kafka: &k\n  input_topics: [in]\n  consumer: *k\n", "$.kafka.consumer: contains itself (a YAML alias"),
    ("kafka: {input_topics: [in]}\nmodel:\n  options: &o\n    self: [*o]\n",
     "$.model.options.self[0]: contains itself"),
])
def test_a_key_that_is_not_text_or_a_section_that_contains_itself_is_named(tmp_path, text, message):
    f = tmp_path / "c.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as e:
        load(f, environ={})
    assert str(e.value).startswith(message)


def test_an_alias_used_twice_is_not_a_cycle(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("kafka:\n  input_topics: [in]\n  consumer: &s {client.rack: r1}\n  producer: *s\n")
    assert load(f, environ={}).kafka.producer == {"client.rack": "r1"}
