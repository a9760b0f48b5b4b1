"""Before a command that talks to a secured broker starts: does the broker let this config in?

librdkafka treats a refused login or a failed TLS handshake like a broker that does not answer: it retries for
ever, and the worker would wait without end, its only sign a log line per retry. ``check_access`` makes a
short-lived client from the consumer's and from the producer's properties, and turns the first refusal the
broker gives into a :class:`~worker.config.settings.ConfigError` (exit 2) that names the key to fix. A broker
that does not answer at all within the wait is left to the command's own handling, as without the check.

Only for a ``security.protocol`` other than PLAINTEXT: a plaintext broker refuses nobody.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from confluent_kafka import KafkaError, Producer

from worker.config.settings import Config, ConfigError
from worker.kafka.clients import consumer_config, producer_config

WAIT_S = 10.0  # for the broker to answer or refuse; librdkafka reports a refusal within a second
_SILENT = logging.getLogger("worker.broker_access")
_SILENT.addHandler(logging.NullHandler())
_SILENT.propagate = False
# A client's own properties only: the rest of its config (group, callbacks, tuning) plays no part in a login.
_ACCESS_PREFIXES = ("bootstrap.servers", "security.protocol", "sasl.", "ssl.", "enable.ssl", "client.id")


def secured(props: dict[str, Any]) -> bool:
    return str(props.get("security.protocol", "plaintext")).strip().lower() != "plaintext"


def refusal(err: KafkaError) -> tuple[tuple[str, ...], str] | None:
    """``(properties, why)`` when ``err`` says the broker refused this client (credentials, certificate, TLS
    trust); None for anything else, such as no broker answering."""
    code, low = err.code(), err.str().lower()
    if code == KafkaError._AUTHENTICATION:
        if "mechanism" in low and "invalid credentials" not in low:
            return ("sasl.mechanism",), "the broker does not offer this SASL mechanism"
        return (("sasl.username", "sasl.password"),
                "the broker refused the SASL login (an unknown user or a wrong password; it does not say "
                "which)")
    if code == KafkaError._SSL:
        if "hostname" in low or "ip address mismatch" in low:
            return (("ssl.endpoint.identification.algorithm",),
                    "the broker's certificate does not name the host in kafka.bootstrap_servers")
        if "certificate verify failed" in low or "could not be verified" in low:
            return ("ssl.ca.location",), "the broker's certificate is not signed by a CA this client trusts"
        return ("security.protocol", "ssl.ca.location"), "the TLS handshake with the broker failed"
    if code == KafkaError._TRANSPORT and re.search(r"alert (bad certificate|certificate required|unknown ca|"
                                                   r"certificate unknown|handshake failure)", low):
        return (("ssl.certificate.location", "ssl.key.location"),
                "the broker requires a client certificate signed by a CA it trusts, and refused this one "
                "(or none)")
    return None


def _probe(props: dict[str, Any], wait_s: float) -> KafkaError | None:
    """The broker's refusal of a client with ``props``, or None once it answered (or nothing came in
    ``wait_s``)."""
    errors: list[KafkaError] = []
    conf = {k: v for k, v in props.items() if k.startswith(_ACCESS_PREFIXES)}
    client = Producer({**conf, "error_cb": errors.append, "logger": _SILENT})
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        client.poll(0.1)  # serves error_cb
        found = next((e for e in errors if refusal(e) is not None), None)
        if found is not None:
            return found
        try:
            if client.list_topics(timeout=0.3).brokers:
                return None
        except Exception:  # noqa: BLE001 - not answered yet: keep waiting for a refusal or an answer
            continue
    return None


def check_access(cfg: Config, wait_s: float = WAIT_S) -> None:
    """Raises ConfigError naming ``$.kafka.<consumer|producer>.<key>`` when the broker refuses the consumer's
    or the producer's properties. Returns when both got in, or when the broker did not answer in
    ``wait_s``."""
    seen: list[dict[str, Any]] = []
    for section, props in (("consumer", consumer_config(cfg)), ("producer", producer_config(cfg))):
        access = {k: v for k, v in props.items() if k.startswith(_ACCESS_PREFIXES) and k != "client.id"}
        if not secured(props) or access in seen:
            continue
        seen.append(access)
        err = _probe(props, wait_s)
        if err is None:
            continue
        found = refusal(err)
        assert found is not None
        keys, why = found
        named = " / ".join(f"$.kafka.{section}.{k}" for k in keys)
        raise ConfigError(f"{named}: {why}; the broker at {cfg.kafka.bootstrap_servers} said: "
                          f"{_first_line(err.str())}")


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0][:300] if text.strip() else "(no detail)"
