"""A throwaway Redis server run from Debian's ``redis-server`` binary.

Used by the tests (``worker demo`` uses no Redis). The server listens on 127.0.0.1
on a free port, keeps nothing on disk (``--save "" --appendonly no``) and writes its log into a temporary
directory. ``stop()`` then ``start()`` brings it back on the SAME port, which is what the outage tests
need: clients configured with the old URL reconnect on their own. ``pause()``/``resume()`` freeze the
process (SIGSTOP/SIGCONT) to simulate a server that accepts connections but never answers.

A password (``requirepass``) goes into a 0600 config file rather than onto the command line, so it does not
show in ``ps``. TLS: pass ``tls_cert_file``/``tls_key_file`` (and ``tls_ca_file``); the server then listens
with TLS only and :attr:`url` is ``rediss://``. ACL users: pass ``users={name: password}``; each may use every
command on keys under ``user_key_pattern`` (``kiw*`` by default), and the ``default`` user is switched off, so
a client that does not log in as one of them gets NOAUTH. Their passwords go into the same 0600 file.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import quote

from worker.local.process import die_with_parent, free_port, terminate


class RedisStartError(RuntimeError):
    """redis-server is missing or did not become ready; the message carries the tail of its log."""


def find_redis_server() -> str:
    path = os.environ.get("KIW_REDIS_SERVER") or shutil.which("redis-server") or "/usr/bin/redis-server"
    if not Path(path).is_file():
        raise RedisStartError(
            "redis-server not found (looked at $KIW_REDIS_SERVER, PATH and /usr/bin); "
            "install it: apt-get install redis-server")
    return path


class LocalRedis:
    """One ``redis-server`` process on 127.0.0.1. Use as a context manager or call start()/close()."""

    def __init__(self, workdir: str | Path | None = None, *, port: int | None = None,
                 password: str | None = None, tls_cert_file: str | Path | None = None,
                 tls_key_file: str | Path | None = None, tls_ca_file: str | Path | None = None,
                 users: dict[str, str] | None = None, user_key_pattern: str = "kiw*",
                 extra_args: list[str] | None = None) -> None:
        self._own_dir = workdir is None
        self.workdir = Path(workdir or tempfile.mkdtemp(prefix="kiw-redis-"))
        self.port = port or free_port()
        self._password = password
        self._users = dict(users or {})
        self._user_keys = user_key_pattern
        if password and self._users:
            raise ValueError("password (the default user's) and users (which switch the default user off) "
                             "exclude each other")
        self.tls = tls_cert_file is not None
        if self.tls and tls_key_file is None:
            raise ValueError("tls_key_file is required with tls_cert_file")
        self._tls_files = (tls_cert_file, tls_key_file, tls_ca_file)
        self.extra_args = list(extra_args or [])
        self.proc: subprocess.Popen[bytes] | None = None
        self._was_ready = False  # set by the first start() that succeeds

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        auth = ", password=***" if self._password else ""
        auth += f", users={sorted(self._users)}" if self._users else ""
        return f"LocalRedis(127.0.0.1:{self.port}, {state}{auth}{', tls' if self.tls else ''})"

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:PORT/0`` (``rediss://`` with TLS). Contains the password if set."""
        auth = f":{quote(self._password, safe='')}@" if self._password else ""
        return f"{'rediss' if self.tls else 'redis'}://{auth}127.0.0.1:{self.port}/0"

    def user_url(self, user: str) -> str:
        """``redis[s]://user:password@127.0.0.1:PORT/0`` for one of the ACL ``users``."""
        secret = quote(self._users[user], safe="")
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://{quote(user, safe='')}:{secret}@127.0.0.1:{self.port}/0"

    @property
    def url_without_password(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://127.0.0.1:{self.port}/0"

    @property
    def log_path(self) -> Path:
        return self.workdir / "redis.log"

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _write_conf(self) -> Path:
        conf = self.workdir / "redis.conf"
        lines = []
        if self._password:
            # Redis config strings: double quotes with backslash escapes.
            escaped = self._password.replace("\\", "\\\\").replace('"', '\\"')
            lines.append(f'requirepass "{escaped}"')
        for name, secret in self._users.items():
            if not name or any(c.isspace() for c in name + secret) or not secret:
                raise ValueError("ACL user names and passwords must be non-empty and without white space")
            lines.append(f"user {name} on >{secret} ~{self._user_keys} &* +@all")
        if self._users:
            lines.append("user default off")
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write("\n".join(lines) + "\n")
        return conf

    def _command(self, binary: str) -> list[str]:
        cmd = [binary, str(self._write_conf()), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(self.workdir), "--daemonize", "no", "--logfile", str(self.log_path),
               "--protected-mode", "no"]
        if self.tls:
            cert, key, ca = self._tls_files
            cmd += ["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", str(cert),
                    "--tls-key-file", str(key), "--tls-auth-clients", "no"]
            if ca is not None:
                cmd += ["--tls-ca-cert-file", str(ca)]
        else:
            cmd += ["--port", str(self.port)]
        return cmd + self.extra_args

    def start(self, timeout: float = 10.0) -> LocalRedis:
        """Start (or restart, on the same port). Returns self once the server answers PING.

        If it fails or is interrupted (Ctrl-C) the process is killed before the exception goes on; a server
        that was never ready also loses its own temporary directory (close())."""
        if self.running:
            return self
        try:
            binary = find_redis_server()
            self.workdir.mkdir(parents=True, exist_ok=True)
            with open(self.workdir / "stdout.log", "ab") as out:
                # Own session: the terminal's Ctrl-C goes to the caller, which stops the server itself.
                # die_with_parent: a caller killed outright (kill -9, SIGTERM, a crash) takes it along.
                self.proc = subprocess.Popen(self._command(binary), stdout=out, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True,
                                             preexec_fn=die_with_parent())
            self._wait_ready(timeout)
        except BaseException:
            if self.proc is not None:
                terminate(self.proc, 5, hard=True, wake=True)
                self.proc = None
            if not self._was_ready:
                self.close()
            raise
        self._was_ready = True
        return self

    def _ping(self) -> bool:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=0.5)
        try:
            if self.tls:
                ctx = ssl.create_default_context()
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
                sock = ctx.wrap_socket(sock)
            sock.sendall(b"PING\r\n")
            reply = sock.recv(64)
        finally:
            sock.close()
        # "-NOAUTH ..." means the server is up and wants the password: ready as well.
        return reply.startswith((b"+PONG", b"-NOAUTH"))

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                code = self.proc.returncode
                self.proc = None
                raise RedisStartError(f"redis-server exited with {code} on port "
                                      f"{self.port}\n{self.log_tail()}")
            try:
                if self._ping():
                    return
            except OSError as e:
                last = e
            time.sleep(0.02)
        raise RedisStartError(f"redis-server not ready after {timeout:.0f}s on port {self.port} ({last})\n"
                              f"{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        parts = []
        for p in (self.workdir / "stdout.log", self.log_path):
            if p.exists():
                text = "\n".join(p.read_text(errors="replace").splitlines()[-lines:])
                parts.append(f"--- {p} ---\n{text}")
        return "\n".join(parts) or "(no server log)"

    def pause(self) -> None:
        """Freeze the server: connections are accepted but never answered (clients hit their timeouts)."""
        if self.running:
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        if self.running:
            assert self.proc is not None
            os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self, timeout: float = 10.0, kill: bool = False) -> None:
        """Shut the server down (SIGTERM, or SIGKILL with ``kill=True``); the port is kept for start()."""
        if self.proc is None:
            return
        terminate(self.proc, timeout, hard=kill, wake=True)  # wake: a paused server cannot handle SIGTERM
        self.proc = None

    def close(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.workdir, ignore_errors=True)
            self._was_ready = False

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
