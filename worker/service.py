"""``worker run``: the runner plus what a deployed service needs around it (metrics/health port, store)."""

from __future__ import annotations

import logging
import signal
import threading
import time

from worker.config import Config, redact

log = logging.getLogger("worker.service")


def run_service(cfg: Config, metrics_port: int | None = None) -> int:
    # A SIGTERM can come while the process is still starting (a rolling update, a scale-in): remember it
    # until the Runner installs its own handlers, then hand it on, so the exit is graceful (0), not -15.
    early: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, _frame: early.append(signum))
    from worker.adapters.memory_store import make_store
    from worker.runner import Runner

    metrics = None
    health_server = None
    state = None
    if cfg.metrics.enabled:
        from worker.adapters.health import HealthServer, HealthState
        from worker.adapters.metrics import PrometheusMetrics

        metrics = PrometheusMetrics()
        state = HealthState()
        port = cfg.metrics.port if metrics_port is None else metrics_port
        health_server = HealthServer(metrics, cfg.metrics.host, port, state)
        health_server.start()
        log.info("metrics and health on port %d", health_server.port)
    log.info("starting", extra={"consumer": redact(dict(cfg.kafka.consumer)),
                                "producer": redact(dict(cfg.kafka.producer)),
                                "model": cfg.model.name, "delivery": cfg.delivery.mode})
    store = make_store(cfg.redis, metrics)
    runner = Runner(cfg, metrics=metrics, store=store, install_signals=True, health=state)
    if early:
        runner.stop()
    if state is not None:
        # Loading and warming a large model can take minutes; the process is alive meanwhile (readiness,
        # not liveness, says it cannot take traffic yet). The loop thread beats once it runs.
        def beat_while_starting() -> None:
            while not runner.ready.wait(5.0):
                state.heartbeat = time.monotonic()

        threading.Thread(target=beat_while_starting, name="startup-heartbeat", daemon=True).start()
    try:
        return runner.run()
    finally:
        if health_server is not None:
            health_server.stop()
