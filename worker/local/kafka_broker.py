"""A single-node Apache Kafka broker (KRaft) run from jars that Maven fetches from Maven Central.

Used by the tests and by ``worker demo`` when no broker address is given. The jars are cached outside
the repository (``~/.cache/kafka-inference-worker/kafka-<version>-<pom hash>/libs``); the broker runs with the
machine's Java on 127.0.0.1, on free ports, with its data in a temporary directory and settings tuned
for fast tests (no initial rebalance delay, replication factors of 1).

With ``security=KafkaSecurity(...)`` it also listens on a SASL_SSL listener (SCRAM-SHA-512; the users are
created through the admin API once the broker is up, so no password goes onto a command line) and on an SSL
listener that requires a client certificate signed by the CA of ``security.certs``. The PLAINTEXT listener
stays, for the tests' own producers and readers; the worker under test is given a secured one.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from worker.local.certs import CertSet
from worker.local.process import die_with_parent, free_ports, terminate

KAFKA_VERSION = "4.1.1"
POM = Path(__file__).with_name("kafka") / "pom.xml"


class BrokerStartError(RuntimeError):
    """The broker did not become ready; the message carries the tail of its log."""


SCRAM_MECHANISM = "SCRAM-SHA-512"


@dataclass(frozen=True, kw_only=True)
class KafkaSecurity:
    """The secured listeners: ``certs`` for TLS on both, ``scram_users`` (name -> password) for SASL_SSL."""

    certs: CertSet
    scram_users: dict[str, str] = field(default_factory=dict)

    def __repr__(self) -> str:  # the passwords stay out of test reports
        return f"KafkaSecurity(certs={self.certs.ca_file.parent}, scram_users={sorted(self.scram_users)})"


def cache_dir() -> Path:
    return Path(os.environ.get("KIW_CACHE", Path.home() / ".cache" / "kafka-inference-worker"))


def jar_dir(version: str = KAFKA_VERSION) -> Path:
    """The cache folder for one Kafka version AND one pom.xml: ``kafka-<version>-<sha256(pom)[:12]>``. A
    changed pom gets a folder of its own, so the change reaches machines that have the old jars, and jars
    that the pom no longer asks for are not left on the classpath."""
    digest = hashlib.sha256(POM.read_bytes()).hexdigest()[:12]
    return cache_dir() / f"kafka-{version}-{digest}"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive flock on ``path``: one fetch at a time per cache folder, across processes."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_jars(version: str = KAFKA_VERSION) -> Path:
    """Fetch the broker jars once per machine (and pom); returns the libs directory.

    Maven copies into a temporary folder beside it, which is renamed into place once complete: a fetch
    that fails or is interrupted leaves no half-filled ``libs``, and concurrent callers wait on a lock."""
    home = jar_dir(version)
    libs = home / "libs"
    marker = libs / ".complete"
    if marker.exists():
        return libs
    if shutil.which("mvn") is None:
        raise BrokerStartError("Maven (mvn) is needed to fetch the Kafka broker jars; install it (apt-get "
                               "install maven)")
    if shutil.which("java") is None:
        raise BrokerStartError("Java 17+ is needed to run the local Kafka broker; install a JDK")
    home.mkdir(parents=True, exist_ok=True)
    with _locked(home / ".lock"):
        if marker.exists():  # fetched by another process while this one waited for the lock
            return libs
        print(f"[kafka] fetching Apache Kafka {version} jars from Maven Central into {libs}", flush=True)
        for stale in home.glob("libs.tmp-*"):  # left by a fetch that was killed; none runs now (the lock)
            shutil.rmtree(stale, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix="libs.tmp-", dir=home))
        try:
            cmd = ["mvn", "-q", "-B", "-f", str(POM), "dependency:copy-dependencies",
                   f"-Dkafka.version={version}", f"-DoutputDirectory={tmp}"]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise BrokerStartError(
                    f"mvn failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
            if not any(tmp.glob("kafka_2.13-*.jar")):
                raise BrokerStartError(f"mvn copied no Kafka jar into {tmp}:\n{proc.stdout[-4000:]}")
            (tmp / ".complete").touch()
            tmp.chmod(0o755)  # mkdtemp made it 0700
            shutil.rmtree(libs, ignore_errors=True)  # an unfinished folder from an older version of this code
            os.rename(tmp, libs)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return libs


_LOG4J2 = """\
<Configuration status="WARN">
  <Appenders>
    <File name="file" fileName="{log}" append="true">
      <PatternLayout pattern="[%d] %p %m (%c)%n"/>
    </File>
  </Appenders>
  <Loggers>
    <Root level="INFO"><AppenderRef ref="file"/></Root>
    <Logger name="kafka.request.logger" level="WARN"/>
    <Logger name="org.apache.kafka.storage" level="WARN"/>
  </Loggers>
</Configuration>
"""


def new_cluster_id() -> str:
    """A random cluster id as Kafka writes them (URL-safe base64 of a UUID), never starting with "-": the
    storage tool would read such an id as an option and fail (1 start in 64). Kafka's own Uuid.randomUuid()
    skips those for the same reason."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


class LocalKafka:
    """One KRaft broker+controller process. ``stop()`` then ``start()`` keeps data and ports (restart)."""

    def __init__(self, workdir: str | Path | None = None, version: str = KAFKA_VERSION,
                 extra_props: dict[str, str] | None = None, security: KafkaSecurity | None = None) -> None:
        self.version = version
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="kiw-kafka-"))
        self.security = security
        self.port, self.controller_port, self.sasl_ssl_port, self.ssl_port = free_ports(4)
        self.extra_props = extra_props or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self._formatted = False
        self._was_ready = False  # set by the first start() that succeeds; a restart then keeps the data

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def sasl_ssl_bootstrap(self) -> str:
        """The SASL_SSL listener (SCRAM-SHA-512); only with ``security``."""
        return f"127.0.0.1:{self.sasl_ssl_port}"

    @property
    def ssl_bootstrap(self) -> str:
        """The SSL listener that requires a client certificate; only with ``security``."""
        return f"127.0.0.1:{self.ssl_port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"

    def _listeners(self) -> dict[str, str]:
        plain = f"PLAINTEXT://127.0.0.1:{self.port}"
        controller = f"CONTROLLER://127.0.0.1:{self.controller_port}"
        if self.security is None:
            return {"listeners": f"{plain},{controller}", "advertised.listeners": plain,
                    "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"}
        certs = self.security.certs
        secured = f"SASL_SSL://{self.sasl_ssl_bootstrap},SSL://{self.ssl_bootstrap}"
        return {
            "listeners": f"{plain},{secured},{controller}",
            "advertised.listeners": f"{plain},{secured}",
            "listener.security.protocol.map":
                "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT,SASL_SSL:SASL_SSL,SSL:SSL",
            "sasl.enabled.mechanisms": SCRAM_MECHANISM,
            f"listener.name.sasl_ssl.{SCRAM_MECHANISM.lower()}.sasl.jaas.config":
                "org.apache.kafka.common.security.scram.ScramLoginModule required;",
            "listener.name.ssl.ssl.client.auth": "required",
            "ssl.keystore.type": "PEM",
            "ssl.keystore.location": str(certs.server_pem),
            "ssl.truststore.type": "PEM",
            "ssl.truststore.location": str(certs.ca_file),
        }

    def client_config(self, listener: str, user: str | None = None) -> dict[str, Any]:
        """librdkafka properties for a client of a secured listener: ``"sasl_ssl"`` (as ``user``, the first
        SCRAM user by default) or ``"ssl"`` (with the client certificate)."""
        if self.security is None:
            raise ValueError("this broker has no secured listeners (LocalKafka(security=...))")
        certs = self.security.certs
        if listener == "sasl_ssl":
            name = user or next(iter(self.security.scram_users))
            return {"bootstrap.servers": self.sasl_ssl_bootstrap, "security.protocol": "SASL_SSL",
                    "sasl.mechanism": SCRAM_MECHANISM, "sasl.username": name,
                    "sasl.password": self.security.scram_users[name], "ssl.ca.location": str(certs.ca_file)}
        if listener == "ssl":
            return {"bootstrap.servers": self.ssl_bootstrap, "security.protocol": "SSL",
                    "ssl.ca.location": str(certs.ca_file), "ssl.certificate.location": str(certs.client_cert),
                    "ssl.key.location": str(certs.client_key)}
        raise ValueError(f"listener must be 'sasl_ssl' or 'ssl', got {listener!r}")

    def _props(self) -> str:
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@127.0.0.1:{self.controller_port}",
            **self._listeners(),
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(self.workdir / "data"),
            "num.partitions": "1",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "4",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "4",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "auto.create.topics.enable": "true",
            "log.flush.interval.messages": "9223372036854775807",
            "num.network.threads": "2",
            "num.io.threads": "4",
            "log.retention.hours": "2",
            "delete.topic.enable": "true",
        }
        props.update(self.extra_props)
        return "".join(f"{k}={v}\n" for k, v in props.items())

    def _java(self, libs: Path, main: str, *args: str) -> list[str]:
        java = os.environ.get("JAVA_HOME") and str(Path(os.environ["JAVA_HOME"]) / "bin" / "java") or "java"
        cmd = [java, "-Xms256m", "-Xmx768m", "-XX:+UseG1GC", "-XX:TieredStopAtLevel=1", "-Xshare:auto",
               f"-Dlog4j2.configurationFile={self.workdir / 'log4j2.xml'}",
               "-Djava.awt.headless=true", "-cp", str(libs / "*"), main, *args]
        return cmd

    def start(self, timeout: float = 90.0) -> LocalKafka:
        """Start (or restart after stop(): same ports and data). Returns self once the broker answers.

        If it fails or is interrupted (Ctrl-C) the process is killed before the exception goes on; a broker
        that was never ready also loses its own temporary directory (close()), a restart keeps its data."""
        if self.proc is not None and self.proc.poll() is None:
            return self
        try:
            self._start(timeout)
        except BaseException:
            self._abort()
            raise
        self._was_ready = True
        return self

    def _abort(self) -> None:
        if self.proc is not None:
            terminate(self.proc, 10, group=True, hard=True)
            self.proc = None
        if not self._was_ready:
            self.close()

    def _start(self, timeout: float) -> None:
        libs = ensure_jars(self.version)
        self.workdir.mkdir(parents=True, exist_ok=True)
        (self.workdir / "server.properties").write_text(self._props())
        (self.workdir / "log4j2.xml").write_text(_LOG4J2.format(log=self.log_path))
        if not self._formatted and not (self.workdir / "data" / "meta.properties").exists():
            cluster_id = new_cluster_id()
            fmt = subprocess.run(
                self._java(libs, "kafka.tools.StorageTool", "format", "-t", cluster_id,
                           "-c", str(self.workdir / "server.properties"), "--ignore-formatted"),
                capture_output=True, text=True)
            if fmt.returncode != 0:
                raise BrokerStartError(f"kafka storage format failed:\n{fmt.stdout}\n{fmt.stderr}")
        self._formatted = True
        with open(self.workdir / "stdout.log", "ab") as out:
            # Own session: the terminal's Ctrl-C goes to the caller, which stops the broker in order.
            # die_with_parent: a caller killed outright (kill -9, SIGTERM, a crash) takes the broker with it.
            self.proc = subprocess.Popen(
                self._java(libs, "kafka.Kafka", str(self.workdir / "server.properties")),
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                preexec_fn=die_with_parent())
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        self._wait_for_metadata({"bootstrap.servers": self.bootstrap}, deadline)
        if self.security is not None:
            self._add_scram_users()
            for listener in ("ssl", "sasl_ssl") if self.security.scram_users else ("ssl",):
                self._wait_for_metadata(self.client_config(listener), deadline)

    def _add_scram_users(self) -> None:
        from confluent_kafka.admin import (
            AdminClient,
            ScramCredentialInfo,
            ScramMechanism,
            UserScramCredentialUpsertion,
        )

        assert self.security is not None
        users = self.security.scram_users
        if not users:
            return
        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})
        info = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 4096)
        futures = admin.alter_user_scram_credentials(
            [UserScramCredentialUpsertion(name, info, password.encode()) for name, password in users.items()])
        for name, fut in futures.items():
            try:
                fut.result(30)
            except Exception as e:  # noqa: BLE001 - reported with the broker's log
                raise BrokerStartError(f"cannot create SCRAM user {name!r}: {e}\n{self.log_tail()}") from None

    def _wait_for_metadata(self, client: dict[str, Any], deadline: float) -> None:
        """Until a client with these properties gets metadata (the broker is up; on a secured listener, its
        TLS and the SCRAM users work), or ``deadline`` (time.monotonic())."""
        from confluent_kafka.admin import AdminClient

        admin = AdminClient({**client, "log_level": 0})
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise BrokerStartError(f"Kafka broker exited with {self.proc.returncode}\n{self.log_tail()}")
            try:
                md = admin.list_topics(timeout=2)
                if md.brokers:
                    return
            except Exception as e:  # noqa: BLE001 - retried until the deadline
                last = e
            time.sleep(0.3)
        raise BrokerStartError(f"Kafka broker not ready on {client['bootstrap.servers']} ({last})\n"
                               f"{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        parts = []
        for p in (self.workdir / "stdout.log", self.log_path):
            if p.exists():
                parts.append(
                    f"--- {p} ---\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines:])
                )
        return "\n".join(parts)

    def stop(self, timeout: float = 30.0) -> None:
        """Controlled shutdown (SIGTERM), SIGKILL if it hangs. Data dir and ports are kept for a restart."""
        if self.proc is None:
            return
        terminate(self.proc, timeout, group=True)
        self.proc = None

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self._formatted = self._was_ready = False

    def __enter__(self) -> LocalKafka:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
