"""The worker against a broker and a Redis that demand credentials (tests/conftest_secure.py): SASL_SSL with
SCRAM-SHA-512, mutual TLS, Redis over TLS with an ACL user. Every byte each process wrote, the metrics and
health responses and ``check-config --print`` are searched for the passwords and the private keys."""

from __future__ import annotations

import json

import pytest
import redis

from tests.conftest_secure import (
    assert_no_secret,
    check_config_print,
    http_get,
    listener_props,
    metrics_base,
    redis_section,
    run_command,
    secrets_of,
    secure_config,
    worker_env,
)
from tests.support.kafka_io import (
    Scenario,
    create_topics,
    decode,
    end_offsets,
    request,
    wait_for,
)

pytestmark = pytest.mark.integration

N = 200


@pytest.mark.parametrize("listener", ["sasl_ssl", "ssl"])
def test_run_replay_and_backfill_over_a_secured_listener(secure_kafka, listener, topic_names, tmp_path):
    sk, bs = secure_kafka, secure_kafka.bootstrap  # bs: the plain listener, for this test's own clients
    scenario = Scenario(bs, topic_names, tmp_path)
    scenario.topics(2)
    scenario.produce([request(i) for i in range(N)])
    scenario.produce([(b"broken", b'{"id": "broken", "inputs": [1,')])
    cfg = secure_config(sk, listener, topic_names, metrics={"enabled": True, "port": 0, "host": "127.0.0.1"})
    env, secrets = worker_env(sk), secrets_of(sk)

    with scenario.worker(cfg, env=env, name="run") as w:
        base = metrics_base(w)
        assert len(scenario.read_out(want=N, timeout=120)) == N
        wait_for(lambda: http_get(base + "/readyz")[0] == 200, 30, what="/readyz 200")
        # The endpoints carry state and counts, never configuration: no secret, and not even the addresses,
        # user name or certificate paths the config holds.
        config_values = [sk.user.encode(), sk.broker.sasl_ssl_bootstrap.encode(),
                         sk.broker.ssl_bootstrap.encode(), str(sk.certs.ca_file).encode(),
                         str(sk.certs.client_key).encode()]
        for path in ("/metrics", "/healthz", "/readyz", "/nothing-here"):
            status, body = http_get(base + path)
            assert status in (200, 404), (path, status)
            assert_no_secret(body, secrets + config_values, f"the response of {path}")
    assert_no_secret(w.log(), secrets, "the worker run's output")
    ids = {v["id"] for v in decode(scenario.read_out(timeout=30, idle=2))}
    assert ids == {f"r-{i}" for i in range(N)}
    dlq = scenario.read_dlq(want=1, timeout=30)
    assert len(dlq) == 1 and dict(dlq[0].headers())["x-error-stage"] == b"decode"

    before = sum(end_offsets(bs, topic_names["in"]).values())
    rc, out, _ = run_command(cfg, tmp_path, "dlq replay", env=env)
    assert rc == 0 and "replayed 1 dead letters" in out, out[-3000:]
    assert_no_secret(out, secrets, "dlq replay's output")
    assert sum(end_offsets(bs, topic_names["in"]).values()) == before + 1

    rc, out, _ = run_command(cfg, tmp_path, "backfill", "--group", f"bf-{topic_names['run']}", env=env)
    assert rc == 0, out[-3000:]
    assert f"{N + 2} records read, {N} ok" in out, out[-3000:]  # the requests, the dead letter and its replay
    assert_no_secret(out, secrets, "backfill's output")

    printed = check_config_print(w.config_path, env)
    assert printed.returncode == 0, printed.stderr.decode()[-2000:]
    assert b"sasl.password" in printed.stdout or listener == "ssl"
    assert_no_secret(printed.stdout + printed.stderr, secrets, "check-config --print")


def test_result_cache_and_ledger_over_redis_tls_with_an_acl_user(secure_kafka, secure_redis, topic_names,
                                                                 tmp_path):
    sk, sr = secure_kafka, secure_redis
    scenario = Scenario(sk.bootstrap, topic_names, tmp_path)
    scenario.topics(1)
    # 40 ids, 10 distinct inputs: the cache answers the repeats; the ledger notes every delivered id.
    scenario.produce([request(i, inputs=[0.1 * (i % 10)] * 16) for i in range(40)])
    prefix = f"kiw-sec-{topic_names['run']}:"
    cfg = secure_config(sk, "sasl_ssl", topic_names, redis=redis_section(sr, tmp_path, prefix, cache=True,
                                                                             ledger=True),
                        metrics={"enabled": True, "port": 0, "host": "127.0.0.1"})
    env = worker_env(sk)
    with scenario.worker(cfg, env=env) as w:
        base = metrics_base(w)
        assert len(scenario.read_out(want=40, timeout=120)) == 40
        client = redis.Redis.from_url(sr.server.user_url(sr.user), ssl_ca_certs=str(sr.certs.ca_file))
        wait_for(lambda: len(list(client.scan_iter(f"{prefix}delivered:*"))) == 40, 30,
                 what="40 ledger entries")
        metrics = http_get(base + "/metrics")[1].decode()
    assert len(list(client.scan_iter(f"{prefix}cache:*"))) == 10
    errors = [ln for ln in metrics.splitlines() if ln.startswith("kiw_redis_errors_total{")]
    assert all(float(ln.rsplit(" ", 1)[1]) == 0 for ln in errors), errors
    assert_no_secret(w.log(), secrets_of(sk, sr), "the worker's output")
    assert_no_secret(metrics, secrets_of(sk, sr), "/metrics")
    printed = check_config_print(w.config_path, env)
    assert printed.returncode == 0 and sr.user.encode() in printed.stdout, printed.stderr.decode()[-2000:]
    assert_no_secret(printed.stdout + printed.stderr, secrets_of(sk, sr), "check-config --print")


def test_exactly_once_over_sasl_ssl(secure_kafka, topic_names, tmp_path):
    sk, n = secure_kafka, 300
    scenario = Scenario(sk.bootstrap, topic_names, tmp_path)  # this test's clients on the plain listener
    scenario.topics(2)
    scenario.produce([request(i, prefix="eos") for i in range(n)])
    cfg = secure_config(sk, "sasl_ssl", topic_names,
                        delivery={"mode": "exactly_once", "transactional_id": f"tx-sec-{topic_names['run']}"})
    results, w = scenario.serve(cfg, want=n, timeout=120, commit_timeout=60, env=worker_env(sk))
    ids = [v["id"] for v in decode(results)]
    assert len(ids) == n and set(ids) == {f"eos-{i}" for i in range(n)}
    assert_no_secret(w.log(), secrets_of(sk), "the worker's output")


# ----------------------------------------------------------------------------------------------- refusals
REFUSALS = {
    # case: (listener, how the properties differ from the good ones, the keys the message must name)
    "wrong_password": ("sasl_ssl", {"sasl.password": "${env:KIW_TEST_WRONG}"},
                       ["$.kafka.consumer.sasl.password", "$.kafka.consumer.sasl.username"]),
    "unknown_user": ("sasl_ssl", {"sasl.username": "mallory"}, ["$.kafka.consumer.sasl.username"]),
    "untrusted_ca": ("ssl", {"ssl.ca.location": "UNTRUSTED"}, ["$.kafka.consumer.ssl.ca.location"]),
    "missing_client_certificate": ("ssl", {"ssl.certificate.location": None, "ssl.key.location": None},
                                   ["$.kafka.consumer.ssl.certificate.location"]),
}
WRONG_PASSWORD = "wrong-but-secret-" + "x7Kq2"  # must not leak either
BOUND_S = 45.0  # start-up (imports, model) plus the refusal; a worker that retries for ever never gets there


def _refused_config(sk, case, names):
    listener, changes, _ = REFUSALS[case]
    props = listener_props(sk, listener)
    for k, v in changes.items():
        if v is None:
            props.pop(k)
        else:
            props[k] = str(sk.certs.untrusted_ca_file) if v == "UNTRUSTED" else v
    return secure_config(sk, listener, names, props=props)


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refused_access_ends_worker_run_fast_with_the_key_named(secure_kafka, case, topic_names, tmp_path):
    sk = secure_kafka
    create_topics(sk.bootstrap, {topic_names["in"]: 1, topic_names["out"]: 1, topic_names["dlq"]: 1})
    cfg = _refused_config(sk, case, topic_names)
    env = {**worker_env(sk), "KIW_TEST_WRONG": WRONG_PASSWORD}
    rc, out, took = run_command(cfg, tmp_path, "run", env=env, timeout=BOUND_S + 30)
    assert rc == 2, f"exit {rc}:\n{out[-3000:]}"
    assert took < BOUND_S, f"took {took:.0f} s"
    line = next((ln for ln in out.splitlines() if ln.startswith("config error:")), "")
    for key in REFUSALS[case][2]:
        assert key in line, out[-3000:]
    assert_no_secret(out, secrets_of(sk, None, WRONG_PASSWORD), "the refused worker's output")


@pytest.mark.parametrize("command", ["backfill", "dlq replay"])
def test_refused_access_ends_backfill_and_replay_fast(secure_kafka, command, topic_names, tmp_path):
    sk = secure_kafka
    create_topics(sk.bootstrap, {topic_names["in"]: 1, topic_names["out"]: 1, topic_names["dlq"]: 1})
    cfg = _refused_config(sk, "wrong_password", topic_names)
    env = {**worker_env(sk), "KIW_TEST_WRONG": WRONG_PASSWORD}
    rc, out, took = run_command(cfg, tmp_path, command, env=env, timeout=BOUND_S + 30)
    assert rc == 2 and "$.kafka.consumer.sasl.password" in out, f"exit {rc}:\n{out[-3000:]}"
    assert took < BOUND_S, f"took {took:.0f} s"
    assert_no_secret(out, secrets_of(sk, None, WRONG_PASSWORD), f"{command}'s output")


def test_readyz_body_names_checks_only(secure_kafka, topic_names, tmp_path):
    """The probe bodies hold their status fields and nothing else (no config value can slip in)."""
    sk = secure_kafka
    cfg = secure_config(sk, "sasl_ssl", topic_names,
                        metrics={"enabled": True, "port": 0, "host": "127.0.0.1"})
    scenario = Scenario(sk.bootstrap, topic_names, tmp_path)
    scenario.topics(1)
    with scenario.worker(cfg, env=worker_env(sk)) as w:
        base = metrics_base(w)
        status, body = http_get(base + "/readyz")
        payload = json.loads(body)
        assert set(payload) == {"status", "checks", "failed"}, payload
        status, body = http_get(base + "/healthz")
        assert set(json.loads(body)) == {"status", "heartbeat_age_s", "heartbeat_timeout_s"}
