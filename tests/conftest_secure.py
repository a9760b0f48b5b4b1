"""pytest plugin: a Kafka broker and a Redis server that demand credentials, for the security tests.

Loaded from tests/conftest.py (``pytest_plugins``). Session fixtures, each started once, only by the tests
that ask for them (plain tests never start them):

- ``secure_certs``: a fresh CA, server and client certificates and an untrusted CA (worker/local/certs.py),
  in a temporary directory.
- ``secure_kafka``: a local broker (worker/local/kafka_broker.py) with a PLAINTEXT listener for the tests'
  own producers and readers, a SASL_SSL listener (SCRAM-SHA-512, user ``kiw-worker`` with a random password)
  and an SSL listener that requires a client certificate.
- ``secure_redis``: a local redis-server with TLS only and one ACL user (``kiw-cache``, random password,
  keys ``kiw*``); the default user is off.

Helpers for the tests against them: ``secure_config`` (a worker config for one secured listener, the
password as ``${env:KIW_TEST_SASL_PASSWORD}``), ``redis_section`` (the TLS server, its user, the password from
a ``${file:...}``), ``secrets_of`` / ``assert_no_secret`` (the leak check), ``run_command``.

Always local processes: a server named by the environment or a container would not have these listeners.
With CI=true a server that cannot start fails the tests that need it; elsewhere they are skipped.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.kafka_io import ROOT, WorkerProcess, wait_for, worker_config
from worker.local.certs import CertSet, make_certs
from worker.local.kafka_broker import BrokerStartError, KafkaSecurity, LocalKafka
from worker.local.redis_server import LocalRedis, RedisStartError

KAFKA_USER = "kiw-worker"
REDIS_USER = "kiw-cache"
PASSWORD_ENV = "KIW_TEST_SASL_PASSWORD"


def unavailable(reason: str) -> None:
    if os.environ.get("CI", "").strip().lower() in ("1", "true", "yes"):
        pytest.fail(f"{reason} (CI=true: a server that cannot start is a failure)", pytrace=False)
    pytest.skip(reason)


@dataclass(frozen=True, kw_only=True)
class SecureKafka:
    broker: LocalKafka
    certs: CertSet
    user: str
    password: str

    @property
    def bootstrap(self) -> str:
        """The PLAINTEXT listener, for the tests' own clients."""
        return self.broker.bootstrap

    def __repr__(self) -> str:
        return f"SecureKafka({self.broker.sasl_ssl_bootstrap}, {self.broker.ssl_bootstrap}, user={self.user})"


@dataclass(frozen=True, kw_only=True)
class SecureRedis:
    server: LocalRedis
    certs: CertSet
    user: str
    password: str

    def __repr__(self) -> str:
        return f"SecureRedis({self.server.url_without_password}, user={self.user})"


@pytest.fixture(scope="session")
def secure_certs(tmp_path_factory: pytest.TempPathFactory) -> CertSet:
    try:
        return make_certs(Path(tmp_path_factory.mktemp("certs")))
    except ImportError as e:
        unavailable(f"cannot make test certificates (trustme/cryptography missing): {e}")
        raise  # unreachable: unavailable() raises


@pytest.fixture(scope="session")
def secure_kafka(secure_certs: CertSet) -> Iterator[SecureKafka]:
    password = secrets.token_urlsafe(18)
    broker = LocalKafka(security=KafkaSecurity(certs=secure_certs, scram_users={KAFKA_USER: password}))
    try:
        broker.start()
    except BaseException as e:
        broker.close()  # nothing (process, temp dir) outlives a failed or interrupted start
        if not isinstance(e, BrokerStartError):
            raise
        unavailable(f"cannot start the secured local Kafka broker: {e}")
        return
    print(f"\n[kafka] secured local broker: SASL_SSL {broker.sasl_ssl_bootstrap}, "
          f"mTLS {broker.ssl_bootstrap}")
    try:
        yield SecureKafka(broker=broker, certs=secure_certs, user=KAFKA_USER, password=password)
    finally:
        broker.close()


@pytest.fixture(scope="session")
def secure_redis(secure_certs: CertSet) -> Iterator[SecureRedis]:
    password = secrets.token_urlsafe(18)
    server = LocalRedis(tls_cert_file=secure_certs.server_cert, tls_key_file=secure_certs.server_key,
                        users={REDIS_USER: password})
    try:
        server.start()
    except BaseException as e:
        server.close()
        if not isinstance(e, RedisStartError):
            raise
        unavailable(f"cannot start the TLS redis-server: {e}")
        return
    print(f"\n[redis] TLS redis-server with ACL user {REDIS_USER} at {server.url_without_password}")
    try:
        yield SecureRedis(server=server, certs=secure_certs, user=REDIS_USER, password=password)
    finally:
        server.close()


# ---------------------------------------------------------------- helpers for the tests against them
def listener_props(sk: SecureKafka, listener: str) -> dict[str, Any]:
    """librdkafka properties for the worker on ``listener`` ("sasl_ssl" or "ssl"). The SCRAM password is a
    secret reference (``${env:...}``), as a deployment passes it; the process gets it in its environment."""
    props = {k: v for k, v in sk.broker.client_config(listener).items() if k != "bootstrap.servers"}
    if "sasl.password" in props:
        props["sasl.password"] = "${env:" + PASSWORD_ENV + "}"
    return props


def secure_config(sk: SecureKafka, listener: str, names: dict[str, str], props: dict[str, Any] | None = None,
                  **sections: Any) -> dict[str, Any]:
    bootstrap = sk.broker.sasl_ssl_bootstrap if listener == "sasl_ssl" else sk.broker.ssl_bootstrap
    props = listener_props(sk, listener) if props is None else props
    cfg = worker_config(bootstrap, names, **sections)
    cfg["kafka"]["consumer"] = {**cfg["kafka"]["consumer"], **props}
    cfg["kafka"]["producer"] = {**cfg["kafka"].get("producer", {}), **props}
    return cfg


def redis_section(sr: SecureRedis, tmp: Path, prefix: str, **extra: Any) -> dict[str, Any]:
    """The worker's redis section for the TLS server and its ACL user; the password from a file."""
    pw_file = tmp / "redis-password"
    pw_file.write_text(sr.password + "\n")
    pw_file.chmod(0o600)
    url = f"rediss://{sr.user}:${{file:{pw_file}}}@127.0.0.1:{sr.server.port}/0"
    return {"url": url, "tls_ca_file": str(sr.certs.ca_file), "key_prefix": prefix, "timeout_ms": 2000,
            **extra}


def secrets_of(sk: SecureKafka, sr: SecureRedis | None = None, *extra: str) -> list[bytes]:
    """What must never appear in anything the worker writes: passwords, and each line of each private key
    (a key may be wrapped or cut anywhere, but a whole 64-character line of one never occurs by chance)."""
    found = [sk.password.encode(), *(e.encode() for e in extra)]
    if sr is not None:
        found.append(sr.password.encode())
    for key in (sk.certs.server_key, sk.certs.client_key):
        found += [ln.encode() for ln in key.read_text().splitlines()
                  if not ln.startswith("-----") and len(ln) >= 40]
    return found


def assert_no_secret(data: bytes | str, secrets: list[bytes], where: str) -> None:
    raw = data.encode() if isinstance(data, str) else data
    leaked = [i for i, s in enumerate(secrets) if s in raw]
    assert not leaked, f"secret #{leaked[0]} (of {len(secrets)}) appears in {where}"


def worker_env(sk: SecureKafka) -> dict[str, str]:
    return {PASSWORD_ENV: sk.password}


def run_command(cfg: dict[str, Any], tmp: Path, command: str, *args: str, env: dict[str, str],
                timeout: float = 120.0, name: str | None = None) -> tuple[int, str, float]:
    """``python -m worker <command> [<args>] --config F`` to completion, stdout and stderr together:
    (exit code, everything it wrote, seconds). ``command`` may be two words ("dlq replay")."""
    name = name or command.replace(" ", "-")
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "worker", *command.split(), "--config", str(path), *args],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout, cwd=str(ROOT),
                          env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", **env})
    return proc.returncode, proc.stdout.decode(errors="replace"), time.monotonic() - t0


def check_config_print(config_path: Path, env: dict[str, str]) -> subprocess.CompletedProcess[bytes]:
    cmd = [sys.executable, "-m", "worker", "check-config", "--config", str(config_path), "--print"]
    return subprocess.run(cmd, capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT), **env},
                          cwd=str(ROOT), timeout=120)


def http_get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def metrics_base(w: WorkerProcess) -> str:
    wait_for(lambda: "metrics and health on port" in w.log()
             or (w.proc is not None and w.proc.poll() is not None), 90, what="the metrics port in the log")
    m = re.search(r"metrics and health on port (\d+)", w.log())
    assert m is not None, w.log()[-3000:]
    return f"http://127.0.0.1:{m.group(1)}"
