"""One HTTP port for Prometheus and Kubernetes probes: ``/metrics``, ``/healthz``, ``/readyz``.

- ``/healthz`` (liveness): 200 while the loop thread's heartbeat is recent (``state.heartbeat``, a
  ``time.monotonic()`` timestamp the runner refreshes every loop iteration), else 503. A stuck loop means
  no heartbeats to the group coordinator either, so restarting the pod is the right answer.
- ``/readyz`` (readiness): 200 when the model is loaded, the broker is reachable and the consumer either
  holds partitions or is waiting for an assignment (an idle replica in a group with more members than
  partitions is still ready); else 503 with a JSON body naming the failed checks.
- ``/metrics``: the text exposition format of the ``PrometheusMetrics`` registry.

Runs a stdlib ``ThreadingHTTPServer`` in a daemon thread; nothing listens until ``start()``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from worker.observability.metrics import CONTENT_TYPE_LATEST, PrometheusMetrics

__all__ = ["HealthServer", "HealthState"]

log = logging.getLogger("worker.health")


@dataclass
class HealthState:
    """Mutable flags the runner updates; the HTTP threads only read them (single attribute reads)."""

    heartbeat: float = field(default_factory=time.monotonic)
    model_loaded: bool = False
    broker_reachable: bool = False
    assigned: bool = False
    waiting_for_assignment: bool = False

    def beat(self, now: float | None = None) -> None:
        self.heartbeat = time.monotonic() if now is None else now


class HealthServer:
    """``HealthServer(metrics, host, port, state).start()``; ``port=0`` picks a free port (see ``.port``)."""

    def __init__(self, metrics: PrometheusMetrics | None, host: str = "0.0.0.0", port: int = 9400,
                 state: HealthState | None = None, *, heartbeat_timeout_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if heartbeat_timeout_s <= 0:
            raise ValueError(f"heartbeat_timeout_s must be > 0, got {heartbeat_timeout_s}")
        self.metrics = metrics
        self.host = host
        self._port = port
        self.state = state if state is not None else HealthState()
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._clock = clock
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        """The bound port (the ephemeral one when constructed with 0, once started)."""
        if self._server is not None:
            return int(self._server.server_address[1])
        return self._port

    @property
    def url(self) -> str:
        host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(self.host, self.host)
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"http://{host}:{self.port}"

    # -- checks (usable without HTTP) ---------------------------------------------------------------
    def liveness(self) -> tuple[bool, dict[str, Any]]:
        age = self._clock() - self.state.heartbeat
        ok = age <= self.heartbeat_timeout_s
        return ok, {"status": "ok" if ok else "stalled", "heartbeat_age_s": round(age, 3),
                    "heartbeat_timeout_s": self.heartbeat_timeout_s}

    def readiness(self) -> tuple[bool, dict[str, Any]]:
        s = self.state
        checks = {
            "model_loaded": bool(s.model_loaded),
            "broker_reachable": bool(s.broker_reachable),
            "assignment": bool(s.assigned or s.waiting_for_assignment),
        }
        failed = [name for name, ok in checks.items() if not ok]
        return not failed, {"status": "ready" if not failed else "not_ready", "checks": checks,
                            "failed": failed}

    def render_metrics(self) -> bytes:
        return b"" if self.metrics is None else self.metrics.render()

    # -- lifecycle ----------------------------------------------------------------------------------
    def start(self) -> HealthServer:
        if self._server is not None:
            return self
        server_cls = _Server6 if ":" in self.host else ThreadingHTTPServer
        server = server_cls((self.host, self._port), _make_handler(self))
        server.daemon_threads = True
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="health-http", daemon=True)
        self._thread.start()
        log.info("health server listening", extra={"host": self.host, "port": self.port})
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is None:
            return
        server.shutdown()
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def __enter__(self) -> HealthServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _Server6(ThreadingHTTPServer):
    """An IPv6 address (``::``, ``::1``...): ThreadingHTTPServer is IPv4 only, and ``metrics.host: "::"`` made
    the worker exit at start. ``::`` also takes IPv4 (dual stack, where the kernel allows it): the kubelet
    probes the pod on whichever family its IP is."""

    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        with contextlib.suppress(OSError, AttributeError):
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        super().server_bind()


def _make_handler(owner: HealthServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = "kiw-health"

        def _send(self, code: int, body: bytes, content_type: str) -> None:
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, ok: bool, payload: dict[str, Any]) -> None:
            self._send(200 if ok else 503, json.dumps(payload).encode() + b"\n", "application/json")

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0].rstrip("/") or "/"
            try:
                if path == "/metrics":
                    self._send(200, owner.render_metrics(), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    self._json(*owner.liveness())
                elif path == "/readyz":
                    self._json(*owner.readiness())
                else:
                    self._send(404, b'{"error": "not found; try /metrics, /healthz, /readyz"}\n',
                               "application/json")
            except Exception:  # a probe must answer, never kill the server thread
                log.exception("health endpoint %s failed", path)
                self._send(500, b'{"error": "internal"}\n', "application/json")

        do_HEAD = do_GET

        def log_message(self, format: str, *args: Any) -> None:
            log.debug("health http: " + format, *args)

    return Handler
