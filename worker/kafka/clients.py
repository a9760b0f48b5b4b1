"""Thin, lazy wrappers around confluent-kafka clients with the settings the delivery rules need.

Only the loop thread calls into these objects (librdkafka callbacks fire from its poll calls).
"""

from __future__ import annotations

import functools
import logging
import os
import re
import socket
from typing import Any

from confluent_kafka import Consumer, KafkaError, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from worker.config.settings import Config
from worker.observability.logs import LibrdkafkaLog

log = logging.getLogger("worker.kafka")

# The worker's correctness depends on these: auto commit / auto offset store would commit records whose
# results were never delivered. config/semantics.py rejects a config that turns them on.
CONSUMER_FIXED = {"enable.auto.commit": False, "enable.auto.offset.store": False}

CONSUMER_DEFAULTS: dict[str, Any] = {
    "auto.offset.reset": "earliest",
    "partition.assignment.strategy": "cooperative-sticky",
    # librdkafka prefetches up to this much per consumer even while the worker is busy; keep it modest
    # so memory stays bounded under overload (paused partitions stop fetching altogether).
    "queued.max.messages.kbytes": 16384,
    # ... and the per-message overhead of that prefetch queue (default 100,000 messages per partition).
    "queued.min.messages": 10000,
    "fetch.wait.max.ms": 50,
    # When a partition's prefetch reaches those thresholds librdkafka postpones its next fetch by this much
    # (default 1000 ms). Under overload a backlogged partition reaches them as soon as it is resumed, and
    # with the default the high-priority lane's partitions stalled for ~1 s at each such resume (the tail
    # of the overload latency benchmark: high-lane p99 968 ms -> 117 ms). 20 ms costs a few more fetches.
    "fetch.queue.backoff.ms": 20,
    "isolation.level": "read_committed",
}

PRODUCER_DEFAULTS: dict[str, Any] = {
    "enable.idempotence": True,
    "acks": "all",
    "linger.ms": 5,
    "batch.num.messages": 10000,
    "compression.type": "lz4",
    # Success is confirmed by the producer draining (worker.output.emit), not by a report per message: each
    # one cost the loop thread 4-6 us. Failures are still reported per message. Setting it to false is safe,
    # only slower.
    "delivery.report.only.error": True,
    "queue.buffering.max.messages": 500000,
    "message.timeout.ms": 120000,
}


def _base(cfg: Config) -> dict[str, Any]:
    return {"bootstrap.servers": cfg.kafka.bootstrap_servers, "client.id": f"kiw-{socket.gethostname()}"}


def client_log(role: str) -> LibrdkafkaLog:
    """The ``logger`` property for a client: librdkafka's lines go through the worker's logging (level,
    format, redaction) as ``worker.kafka.<role>``, never raw to stderr (as librdkafka writes them without
    one). They are served by the client's poll/consume calls."""
    return LibrdkafkaLog(f"worker.kafka.{role}")


def consumer_config(cfg: Config, group_id: str | None = None, **extra: Any) -> dict[str, Any]:
    conf = {**_base(cfg), "group.id": group_id or cfg.kafka.group_id, **CONSUMER_DEFAULTS}
    conf.update(cfg.kafka.consumer)
    conf.update(extra)
    conf.update(CONSUMER_FIXED)
    conf.setdefault("logger", client_log("consumer"))
    return conf


def producer_config(cfg: Config, **extra: Any) -> dict[str, Any]:
    conf = {**_base(cfg), **PRODUCER_DEFAULTS}
    conf.update(cfg.kafka.producer)
    conf.update(extra)
    conf.setdefault("logger", client_log("producer"))
    return conf


# librdkafka names the property it refuses in quotes or backquotes: 'No such configuration property:
# "sesion.timeout.ms"', 'Invalid value for configuration property "session.timeout.ms"', '`acks` must be set
# to
# `all` when `enable.idempotence` is true', 'ssl.ca.location failed: ...', 'on_commit requires a callable'.
_NAMED = re.compile(r'"([a-z0-9_.]+)"|`([a-z0-9_.]+)(?:=[^`]*)?`|^([a-z0-9_.]+) (?:failed|requires)')
_SILENT = logging.getLogger("worker.kafka.config_check")
_SILENT.addHandler(logging.NullHandler())
_SILENT.propagate = False


# Properties naming a file librdkafka reads when it makes the client (a CA, a key, a keytab...).
FILE_PROPERTIES = frozenset({
    "ssl.ca.location", "ssl.certificate.location", "ssl.key.location", "ssl.keystore.location",
    "ssl.crl.location", "ssl.engine.location", "sasl.kerberos.keytab",
})


def absent_files(cfg: Config) -> list[tuple[str, str]]:
    """``(path, file)`` of each file-valued client property whose file is not on this machine."""
    return [
        (f"$.kafka.{section}.{k}", v)
        for section, conf in (("consumer", cfg.kafka.consumer), ("producer", cfg.kafka.producer))
        for k, v in sorted(conf.items())
        if k in FILE_PROPERTIES
        and isinstance(v, str)
        and v.strip()
        and v != "probe"
        and not os.path.exists(v)
    ]


def config_problem(cfg: Config, files_elsewhere: bool = False) -> tuple[str, str] | None:
    """What librdkafka would refuse when ``worker run`` makes its consumer or producer (a misspelt property, a
    value out of range, two properties that do not go together, a CA file that is not there) as
    ``(path, message)``, found by making each client without a broker to talk to and closing it at once; None
    when both are fine. A few milliseconds, and the result is kept for each pair of client configurations.
    ``files_elsewhere`` (check-config, which may run outside the pod its secrets are mounted in): a
    file-valued property whose file is not here is left out of the check instead of refused (``absent_files``
    lists
    them)."""
    absent = absent_files(cfg)
    if absent and not files_elsewhere:
        path, file = absent[0]
        return path, f"no such file on this machine: {file}"
    skip = {path.split(".", 3)[3] for path, _ in absent}  # "$.kafka.consumer.ssl.ca.location" -> the property
    consumer = _offline({k: v for k, v in consumer_config(cfg).items() if k not in skip})
    # As runner.Runner.run makes it (its transactional.id is per instance, any one does here).
    extra = transactional_extra(cfg, "config-check") if cfg.delivery.mode == "exactly_once" else {}
    producer = {k: v for k, v in producer_config(cfg, **extra).items() if k not in skip}
    return _problem(tuple(consumer.items()), tuple(_offline(producer).items()),
                    frozenset(cfg.kafka.consumer), frozenset(cfg.kafka.producer))


def transactional_extra(cfg: Config, transactional_id: str) -> dict[str, Any]:
    """The producer properties exactly-once mode adds: its transactional.id, and, unless the config sets one,
    a message.timeout.ms no longer than transaction.timeout.ms (librdkafka requires it; 60 s by default)."""
    extra: dict[str, Any] = {"transactional.id": transactional_id}
    if "message.timeout.ms" not in cfg.kafka.producer:
        extra["message.timeout.ms"] = cfg.kafka.producer.get("transaction.timeout.ms", 60000)
    return extra


def _offline(conf: dict[str, Any]) -> dict[str, Any]:
    """``conf`` for a client that reaches nothing while it exists: librdkafka connects to its bootstrap
    servers as soon as it is made, fetches an OIDC token over HTTP (sasl.oauthbearer.method=oidc), runs
    kinit (GSSAPI), and a plugin may do anything. Everything else is checked as given."""
    conf = {k: v for k, v in conf.items() if k not in ("bootstrap.servers", "plugin.library.paths", "logger")}
    if str(conf.get("sasl.oauthbearer.method", "")).strip().lower() == "oidc":
        conf["sasl.oauthbearer.method"] = "default"
    # the default
    if "GSSAPI" in str(conf.get("sasl.mechanisms", conf.get("sasl.mechanism", "GSSAPI"))).upper():
        conf["sasl.kerberos.min.time.before.relogin"] = 0  # 0: no kinit
    return conf


@functools.lru_cache(maxsize=64)
def _problem(consumer: tuple[tuple[str, Any], ...], producer: tuple[tuple[str, Any], ...],
             consumer_keys: frozenset[str], producer_keys: frozenset[str]) -> tuple[str, str] | None:
    for section, conf, given in (("consumer", consumer, consumer_keys),
                                 ("producer", producer, producer_keys)):
        text = _refusal(section, dict(conf))
        if text is None:
            continue
        named = [next(g for g in m.groups() if g) for m in _NAMED.finditer(text)]
        # The property in the section the user wrote; else the one refused on its own under another of its
        # names (linger.ms is "queue.buffering.max.ms" to librdkafka); else the section (a property missing,
        # or one that does not go with a default).
        prop = next((n for n in named if n in given), None)
        if prop is None and "configuration property" in text:
            prop = next((k for k in sorted(given)
                         if _refusal(section, {"group.id": "config-check", k: dict(conf)[k]}) == text), None)
        return f"$.kafka.{section}" + (f".{prop}" if prop else ""), f"librdkafka refuses it: {text}"
    return None


def _refusal(section: str, conf: dict[str, Any]) -> str | None:
    """librdkafka's reason for refusing to make the client, or None when it made one (closed at once)."""
    from confluent_kafka import KafkaException

    # Its log lines (CONFWARN: "No bootstrap.servers configured") are only served by a poll: none here.
    conf = {**conf, "logger": _SILENT}
    try:
        if section == "consumer":
            Consumer(conf).close()
        else:
            conf.pop("group.id", None)
            Producer(conf)  # destroyed on the spot: nothing to send, no broker
    except (KafkaException, TypeError, ValueError) as e:
        kerr = e.args[0] if e.args else None
        text = kerr.str() if isinstance(kerr, KafkaError) else str(e)
        return re.sub(r"^Failed to create (consumer|producer): ", "", text.strip())
    return None


def make_consumer(cfg: Config, **extra: Any) -> Consumer:
    return Consumer(consumer_config(cfg, **extra))


def make_producer(cfg: Config, **extra: Any) -> Producer:
    return Producer(producer_config(cfg, **extra))


def ensure_topics(bootstrap: str | dict[str, Any], topics: dict[str, int], timeout: float = 30.0) -> None:
    """Create topics that do not exist yet (name -> partitions). Existing ones are left as they are."""
    conf = {"bootstrap.servers": bootstrap} if isinstance(bootstrap, str) else bootstrap
    admin = AdminClient({"logger": client_log("admin"), **conf})
    existing = set(admin.list_topics(timeout=timeout).topics)
    new = [NewTopic(t, num_partitions=n, replication_factor=1 if "127.0.0.1" in str(conf) else -1)
           for t, n in topics.items() if t not in existing]
    if not new:
        return
    for topic, fut in admin.create_topics(new, operation_timeout=timeout).items():
        try:
            fut.result(timeout)
        except Exception as e:  # already exists (race with another worker) is fine
            if "TOPIC_ALREADY_EXISTS" not in str(e):
                raise RuntimeError(f"cannot create topic {topic!r}: {e}") from e


_TRANSIENT = {"NOT_COORDINATOR", "COORDINATOR_LOAD_IN_PROGRESS", "COORDINATOR_NOT_AVAILABLE", "_TIMED_OUT",
              "_TRANSPORT", "REQUEST_TIMED_OUT", "_WAIT_COORD", "LEADER_NOT_AVAILABLE",
              "NOT_LEADER_FOR_PARTITION"}


def retry_transient(fn: Any, *args: Any, timeout: float = 60.0, **kwargs: Any) -> Any:
    """Calls ``fn`` until it stops failing with a transient broker error (a coordinator that is still
    loading, a leader election) or ``timeout`` passes. Other errors propagate at once. ``fn`` takes a
    ``timeout`` keyword (the confluent-kafka calls this is for do): each call gets what is left of
    ``timeout``, since without one a call waits forever (e.g. for a partition leader it cannot reach)."""
    import time

    from confluent_kafka import KafkaException

    deadline = time.monotonic() + timeout
    delay = 0.1
    while True:
        try:
            return fn(*args, timeout=max(deadline - time.monotonic(), 0.1), **kwargs)
        except KafkaException as e:
            err = e.args[0] if e.args else None
            transient = err is not None and (err.retriable() or err.name() in _TRANSIENT)
            if not transient or time.monotonic() + delay > deadline:
                raise
            log.info("transient broker error, retrying: %s", err)
            time.sleep(delay)
            delay = min(delay * 2, 2.0)
