"""``worker run``: the runner plus what a deployed service needs around it (metrics/health port, store)."""

from __future__ import annotations

import errno
import logging
import signal
import threading
import time
from typing import Any

from worker.config.settings import Config, redact

log = logging.getLogger("worker.service")


def run_service(cfg: Config, metrics_port: int | None = None) -> int:
    from worker.app.command_support import CommandError, check_devices

    # The service's own handlers, installed first: a SIGTERM can come while the process is still starting (a
    # rolling update, a scale-in) or loading the model (seconds to minutes, not interruptible). Either way it
    # asks the runner to stop as soon as it can, so the exit is graceful (0), not -15. A second Ctrl-C while
    # the model loads gives up on that (KeyboardInterrupt: exit 130); once running, stopping is the runner's
    # bounded graceful shutdown and further signals change nothing.
    runners: list[Any] = []
    requests = 0

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal requests
        requests += 1
        runner = runners[0] if runners else None
        if runner is not None and (runner.ready.is_set() or runner.models_loaded):
            # Loaded: the stop is the runner's bounded graceful shutdown (a KeyboardInterrupt raised in its
            # setup would leave clients it created unclosed).
            runner.stop()
            return
        if requests == 1:
            log.warning("stop requested; finishing the model load first (Ctrl-C again to exit at once)")
        elif signum == signal.SIGINT:
            raise KeyboardInterrupt
        if runner is not None:
            runner.stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    from worker.pipeline.runner import Runner
    from worker.store.from_config import make_store

    # Before the health port opens: a device this machine lacks is the config's fault (exit 2), not a crash.
    check_devices(cfg)
    # ... and so is a secured broker refusing its credentials or certificates (librdkafka would retry for
    # ever).
    from worker.kafka.access import check_access

    check_access(cfg)
    metrics = None
    health_server = None
    state = None
    if cfg.metrics.enabled:
        from worker.observability.health import HealthServer, HealthState
        from worker.observability.metrics import PrometheusMetrics

        metrics = PrometheusMetrics()
        state = HealthState()
        port = cfg.metrics.port if metrics_port is None else metrics_port
        health_server = HealthServer(metrics, cfg.metrics.host, port, state)
        try:
            health_server.start()
        except OSError as e:
            source = "--metrics-port" if metrics_port is not None else "$.metrics.port"
            why = "address already in use" if e.errno == errno.EADDRINUSE else (e.strerror or str(e)).lower()
            raise CommandError(f"cannot serve metrics on {cfg.metrics.host}:{port} ($.metrics.host, "
                               f"{source}): {why}") from None
        log.info("metrics and health on port %d", health_server.port)
    log.info("starting", extra={"consumer": redact(dict(cfg.kafka.consumer)),
                                "producer": redact(dict(cfg.kafka.producer)),
                                "model": cfg.model.name, "delivery": cfg.delivery.mode})
    store = make_store(cfg.redis, metrics)
    runner = Runner(cfg, metrics=metrics, store=store, health=state)
    runners.append(runner)
    if requests:
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
