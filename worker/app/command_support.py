"""What the commands share: the one-line runtime failure (exit 1), the message for a broker that does not
answer, and the device check every command that runs the model makes before it starts."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from worker.config.settings import Config, ConfigError

# librdkafka's codes for "no broker answered" (as opposed to e.g. an authorization failure or a missing
# topic).
_UNREACHABLE = {"_TRANSPORT", "_TIMED_OUT", "_ALL_BROKERS_DOWN", "_RESOLVE", "_MSG_TIMED_OUT"}


class CommandError(Exception):
    """A runtime failure whose message says all there is to say (exit 1): printed as one line, no traceback,
    unlike an unexpected exception."""


@contextlib.contextmanager
def unreachable_broker_is_an_error(bootstrap: str, source: str, timeout_s: float) -> Iterator[None]:
    """Turns a KafkaException saying that no broker answered into the one message for it (demo, dlq replay,
    backfill): where the address came from, so the reader knows what to fix. Other Kafka errors propagate."""
    from confluent_kafka import KafkaException

    try:
        yield
    except KafkaException as e:
        kerr: Any = e.args[0] if e.args else None
        if not (hasattr(kerr, "name") and kerr.name() in _UNREACHABLE):
            raise
        detail = kerr.str() if hasattr(kerr, "str") else str(e)
        raise CommandError(f"cannot reach Kafka at {bootstrap} (from {source}) within {timeout_s:g} "
                           f"s: {detail}") from None



def check_devices(cfg: Config) -> None:
    """A device the config names but this machine lacks (cuda without CUDA, cuda:3 with two GPUs) is a
    ConfigError naming $.model.device(s), raised before anything starts."""
    from worker.device.engine import resolve_device

    specs = [(f"$.model.devices[{i}]", d) for i, d in enumerate(cfg.model.devices)] or [
        ("$.model.device", cfg.model.device)]
    for key, spec in specs:
        try:
            resolve_device(spec)
        except ValueError as e:
            # resolve_device names $.model.device whichever key the spec came from.
            msg = str(e).removeprefix("$.model.device: ")
            raise ConfigError(msg if msg.startswith("$.") else f"{key}: {msg}") from None
