"""A single-node Apache Kafka broker (KRaft) run from jars that Maven fetches from Maven Central.

Used by the tests and by ``worker demo`` when no broker address is given. The jars are cached outside
the repository (``~/.cache/kafka-inference-worker/kafka-<version>-<pom hash>/libs``); the broker runs with the
machine's Java on 127.0.0.1, on free ports, with its data in a temporary directory and settings tuned
for fast tests (no initial rebalance delay, replication factors of 1).
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
from pathlib import Path

from worker.local.process import die_with_parent, free_ports, terminate

KAFKA_VERSION = "4.1.1"
POM = Path(__file__).with_name("kafka") / "pom.xml"


class BrokerStartError(RuntimeError):
    """The broker did not become ready; the message carries the tail of its log."""


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
        raise BrokerStartError("Maven (mvn) is needed to fetch the Kafka broker jars; install it (apt-get install maven)")
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
                 extra_props: dict[str, str] | None = None) -> None:
        self.version = version
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="kiw-kafka-"))
        self.port, self.controller_port = free_ports(2)
        self.extra_props = extra_props or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self._formatted = False
        self._was_ready = False  # set by the first start() that succeeds; a restart then keeps the data

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "server.log"

    def _props(self) -> str:
        props = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@127.0.0.1:{self.controller_port}",
            "listeners": f"PLAINTEXT://127.0.0.1:{self.port},CONTROLLER://127.0.0.1:{self.controller_port}",
            "advertised.listeners": f"PLAINTEXT://127.0.0.1:{self.port}",
            "controller.listener.names": "CONTROLLER",
            "inter.broker.listener.name": "PLAINTEXT",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
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
        from confluent_kafka.admin import AdminClient

        deadline = time.monotonic() + timeout
        admin = AdminClient({"bootstrap.servers": self.bootstrap, "log_level": 0})
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
        raise BrokerStartError(f"Kafka broker not ready after {timeout:.0f}s ({last})\n{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        parts = []
        for p in (self.workdir / "stdout.log", self.log_path):
            if p.exists():
                parts.append(f"--- {p} ---\n" + "\n".join(p.read_text(errors="replace").splitlines()[-lines:]))
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
