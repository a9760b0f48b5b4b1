"""worker/local/: the jar cache, cleanup of a failed or interrupted start, dying with the parent, free ports.

No broker and no redis-server are started: stand-in commands (``sleep``, small scripts) play the servers.
The one test that runs Java (the broker's logging) takes about two seconds and needs the jars already
fetched (setup_env.sh fetches them before the tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

import worker.local.kafka_broker as kb
import worker.local.redis_server as rs
from tests.support import needs
from worker.local.process import die_with_parent, free_ports

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="prctl(PR_SET_PDEATHSIG) is Linux")


def alive(pid: int) -> bool:
    """Running (a zombie nobody has reaped yet counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_dead(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + textwrap.dedent(body))
    path.chmod(0o755)
    return path


# --- free ports ------------------------------------------------------------------------------------

def test_free_ports_are_distinct() -> None:
    for _ in range(50):
        ports = free_ports(2)
        assert len(set(ports)) == 2
    assert len(set(free_ports(30))) == 30


def test_a_broker_gets_two_different_ports() -> None:
    b = kb.LocalKafka()
    try:
        assert b.port != b.controller_port
    finally:
        b.close()


# --- dying with the parent -------------------------------------------------------------------------

@linux_only
def test_die_with_parent_only_from_the_main_thread() -> None:
    assert callable(die_with_parent())
    got: list[object] = []
    t = threading.Thread(target=lambda: got.append(die_with_parent()))
    t.start()
    t.join()
    assert got == [None]  # the signal would come when that thread exits, not the process


@linux_only
def test_a_server_dies_when_its_parent_is_killed() -> None:
    """The parent is SIGKILLed (no finally, no atexit): the child in its own session still goes."""
    parent_code = textwrap.dedent("""
        import subprocess, time
        from worker.local.process import die_with_parent
        p = subprocess.Popen(["sleep", "120"], start_new_session=True, preexec_fn=die_with_parent())
        print(p.pid, flush=True)
        time.sleep(120)
    """)
    parent = subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert alive(child)
        parent.send_signal(signal.SIGKILL)
        parent.wait(10)
        assert wait_dead(child), "the child outlived its parent"
    finally:
        parent.kill()
        parent.wait(10)


# --- a failed or interrupted start leaves nothing behind -------------------------------------------

@pytest.fixture
def fake_redis(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A "redis-server" that runs but never answers PING."""
    path = script(tmp_path / "redis-server", "exec sleep 120\n")
    monkeypatch.setenv("KIW_REDIS_SERVER", str(path))
    return path


def test_redis_that_never_answers_is_killed_and_its_dir_removed(fake_redis: Path) -> None:
    server = rs.LocalRedis()
    with pytest.raises(rs.RedisStartError, match="not ready"):
        server.start(timeout=0.3)
    assert server.proc is None
    assert not server.workdir.exists()


def test_redis_start_interrupted_by_ctrl_c_cleans_up(fake_redis: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    pids: list[int] = []

    def interrupted(self: rs.LocalRedis, timeout: float) -> None:
        assert self.proc is not None
        pids.append(self.proc.pid)
        raise KeyboardInterrupt

    monkeypatch.setattr(rs.LocalRedis, "_wait_ready", interrupted)
    server = rs.LocalRedis()
    with pytest.raises(KeyboardInterrupt):
        server.start()
    assert server.proc is None and not server.workdir.exists()
    assert wait_dead(pids[0], 5)


def never_ready(self: rs.LocalRedis, timeout: float) -> None:
    raise rs.RedisStartError("not ready")


def test_redis_restart_failure_keeps_the_dir(fake_redis: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rs.LocalRedis, "_wait_ready", lambda self, timeout: None)
    server = rs.LocalRedis()
    try:
        server.start()
        server.stop(kill=True)
        monkeypatch.setattr(rs.LocalRedis, "_wait_ready", never_ready)
        with pytest.raises(rs.RedisStartError):
            server.start()
        assert server.proc is None and server.workdir.exists()  # a restart keeps what it has
    finally:
        server.close()
    assert not server.workdir.exists()


@pytest.fixture
def fake_kafka(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """LocalKafka with the jars, the storage tool and the broker replaced: the "broker" is a sleep."""
    pids: list[int] = []
    monkeypatch.setattr(kb, "ensure_jars", lambda version=kb.KAFKA_VERSION: tmp_path)

    def java(self: kb.LocalKafka, libs: Path, main: str, *args: str) -> list[str]:
        return ["sleep", "120"] if main == "kafka.Kafka" else ["true"]

    def interrupted(self: kb.LocalKafka, timeout: float) -> None:
        assert self.proc is not None
        pids.append(self.proc.pid)
        raise KeyboardInterrupt

    monkeypatch.setattr(kb.LocalKafka, "_java", java)
    monkeypatch.setattr(kb.LocalKafka, "_wait_ready", interrupted)
    return pids


def test_broker_start_interrupted_by_ctrl_c_cleans_up(fake_kafka: list[int]) -> None:
    broker = kb.LocalKafka()
    with pytest.raises(KeyboardInterrupt):
        broker.start()
    assert broker.proc is None and not broker.workdir.exists()
    assert wait_dead(fake_kafka[0], 5)


def test_broker_restart_failure_keeps_its_data(fake_kafka: list[int],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    broker = kb.LocalKafka()
    try:
        broker._was_ready = True  # as after a first start that succeeded
        with pytest.raises(KeyboardInterrupt):
            broker.start()
        assert broker.proc is None and broker.workdir.exists()
        assert wait_dead(fake_kafka[0], 5)
    finally:
        broker.close()
    assert not broker.workdir.exists()


def test_broker_without_jars_removes_its_dir(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_jars(version: str = kb.KAFKA_VERSION) -> Path:
        raise kb.BrokerStartError("no mvn")

    monkeypatch.setattr(kb, "ensure_jars", no_jars)
    broker = kb.LocalKafka()
    with pytest.raises(kb.BrokerStartError):
        broker.start()
    assert not broker.workdir.exists()


# --- the jar cache -----------------------------------------------------------------------------------

def test_the_jar_folder_is_keyed_by_version_and_pom(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KIW_CACHE", str(tmp_path))
    pom = tmp_path / "pom.xml"
    pom.write_text("<project>1</project>")
    monkeypatch.setattr(kb, "POM", pom)
    first = kb.jar_dir("4.1.1")
    assert first.parent == tmp_path and first.name.startswith("kafka-4.1.1-") and len(first.name) == 24
    assert kb.jar_dir("4.1.1") == first
    assert kb.jar_dir("4.0.0") != first
    pom.write_text("<project>2</project>")
    assert kb.jar_dir("4.1.1") != first


@pytest.fixture
def fake_maven(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """``mvn`` and ``java`` on PATH: mvn "copies" two jars into -DoutputDirectory, or fails with MVN_FAIL."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script(bin_dir / "java", "exit 0\n")
    script(bin_dir / "mvn", """\
        [ -n "$MVN_FAIL" ] && { echo "mvn: no network"; exit 1; }
        for a in "$@"; do case "$a" in -DoutputDirectory=*) out="${a#-DoutputDirectory=}";; esac; done
        touch "$out/kafka_2.13-4.1.1.jar" "$out/slf4j-api-1.7.36.jar"
        echo run >> "$(dirname "$0")/runs"
        """)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("KIW_CACHE", str(tmp_path / "cache"))
    return bin_dir


def test_jars_are_fetched_once_into_place(fake_maven: Path) -> None:
    libs = kb.ensure_jars()
    assert libs == kb.jar_dir() / "libs"
    assert sorted(p.name for p in libs.iterdir()) == [".complete", "kafka_2.13-4.1.1.jar",
                                                      "slf4j-api-1.7.36.jar"]
    assert kb.ensure_jars() == libs
    assert (fake_maven / "runs").read_text().count("run") == 1
    assert [p.name for p in libs.parent.iterdir() if p.name.startswith("libs.tmp")] == []


def test_a_failed_fetch_leaves_no_libs(fake_maven: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MVN_FAIL", "1")
    with pytest.raises(kb.BrokerStartError, match="no network"):
        kb.ensure_jars()
    home = kb.jar_dir()
    assert sorted(p.name for p in home.iterdir()) == [".lock"]
    monkeypatch.delenv("MVN_FAIL")
    assert (kb.ensure_jars() / ".complete").exists()


def test_concurrent_fetches_run_maven_once(fake_maven: Path) -> None:
    errors: list[BaseException] = []

    def fetch() -> None:
        try:
            kb.ensure_jars()
        except BaseException as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    threads = [threading.Thread(target=fetch) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert (fake_maven / "runs").read_text().count("run") == 1


# --- the broker's logging ----------------------------------------------------------------------------

def test_the_cached_jars_bind_slf4j_to_log4j() -> None:
    """slf4j-api 1.x finds only an SLF4J 1 binding (log4j-slf4j-impl), 2.x only a provider
    (log4j-slf4j2-impl); with the wrong one the broker logs nothing."""
    libs = kb.jar_dir() / "libs"
    if not (libs / ".complete").exists():
        needs.missing(f"Kafka jars not fetched yet ({libs}); make setup fetches them")
    names = [p.name for p in libs.iterdir()]
    api = [n for n in names if n.startswith("slf4j-api-")]
    assert len(api) == 1, api
    binding = "log4j-slf4j-impl-" if api[0].startswith("slf4j-api-1.") else "log4j-slf4j2-impl-"
    assert (
        [n for n in names if n.startswith("log4j-slf4j")] == [n for n in names if n.startswith(binding)] != []
    )


def test_kafka_writes_its_log_file(tmp_path: Path) -> None:
    """The storage tool (as start() runs it, ~2 s of Java) logs its config through SLF4J into server.log."""
    libs = kb.jar_dir() / "libs"
    if not (libs / ".complete").exists():
        needs.missing(f"Kafka jars not fetched yet ({libs}); make setup fetches them")
    broker = kb.LocalKafka(workdir=tmp_path)
    (tmp_path / "server.properties").write_text(broker._props())
    (tmp_path / "log4j2.xml").write_text(kb._LOG4J2.format(log=broker.log_path))
    fmt = subprocess.run(broker._java(libs, "kafka.tools.StorageTool", "format", "-t", kb.new_cluster_id(),
                                      "-c", str(tmp_path / "server.properties")),
                         capture_output=True, text=True, timeout=120)
    assert fmt.returncode == 0, fmt.stdout + fmt.stderr
    assert "NOP" not in fmt.stdout + fmt.stderr
    assert broker.log_path.exists() and " INFO " in broker.log_path.read_text()
