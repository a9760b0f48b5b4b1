"""A single-node Apache Kafka broker (KRaft) run from jars that Maven fetches from Maven Central.

Used by the tests and by ``worker demo`` when no broker address is given. The jars are cached outside
the repository (``~/.cache/kafka-inference-worker/kafka-<version>/libs``); the broker runs with the
machine's Java on 127.0.0.1, on free ports, with its data in a temporary directory and settings tuned
for fast tests (no initial rebalance delay, replication factors of 1).
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

from worker.local.process import free_port, terminate

KAFKA_VERSION = "4.1.1"
POM = Path(__file__).with_name("kafka") / "pom.xml"


class BrokerStartError(RuntimeError):
    """The broker did not become ready; the message carries the tail of its log."""


def cache_dir() -> Path:
    return Path(os.environ.get("KIW_CACHE", Path.home() / ".cache" / "kafka-inference-worker"))


def ensure_jars(version: str = KAFKA_VERSION) -> Path:
    """Fetch the broker jars once per machine; returns the libs directory."""
    libs = cache_dir() / f"kafka-{version}" / "libs"
    marker = libs / ".complete"
    if marker.exists():
        return libs
    if shutil.which("mvn") is None:
        raise BrokerStartError("Maven (mvn) is needed to fetch the Kafka broker jars; install it (apt-get install maven)")
    if shutil.which("java") is None:
        raise BrokerStartError("Java 17+ is needed to run the local Kafka broker; install a JDK")
    libs.mkdir(parents=True, exist_ok=True)
    print(f"[kafka] fetching Apache Kafka {version} jars from Maven Central into {libs}", flush=True)
    cmd = [
        "mvn", "-q", "-B", "-f", str(POM), "dependency:copy-dependencies",
        f"-Dkafka.version={version}", f"-DoutputDirectory={libs}", "-DincludeScope=runtime",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise BrokerStartError(f"mvn failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    marker.touch()
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
        self.port = free_port()
        self.controller_port = free_port()
        self.extra_props = extra_props or {}
        self.proc: subprocess.Popen[bytes] | None = None
        self._formatted = False

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
        out = open(self.workdir / "stdout.log", "ab")
        self.proc = subprocess.Popen(
            self._java(libs, "kafka.Kafka", str(self.workdir / "server.properties")),
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        out.close()
        self._wait_ready(timeout)
        return self

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
        self.stop()
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

    def __enter__(self) -> LocalKafka:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
