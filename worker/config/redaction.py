"""What of a config may be shown: secret-looking keys and URL passwords are masked."""

from __future__ import annotations

from typing import Any

from worker.observability.logs import is_secret_key
from worker.observability.logs import redact as redact_log

# Matched by logs.is_secret_key ("-" and "." read as "_"); fewer sasl keys than the log redactor masks:
# sasl.mechanisms and sasl.username stay visible.
SECRET_WORDS = ("password", "passwd", "secret", "token", "sasl_jaas", "sasl_oauthbearer_config", "key_pem",
                "private", "credential", "api_key", "apikey", "authorization")


def is_secret(key: str) -> bool:
    return is_secret_key(key, SECRET_WORDS)


def redact(props: dict[str, Any]) -> dict[str, Any]:
    """A copy safe to log: values of secret-looking keys are replaced."""
    return {k: ("***" if is_secret(k) else v) for k, v in props.items()}


def redact_config(value: Any, key: str = "") -> Any:
    """A copy of a config value (``to_dict(cfg)`` for one) safe to print: values of secret-looking keys
    become ``***`` at any depth (an empty one stays visible as such), and so do passwords in URLs."""
    return redact_log(key, value, words=SECRET_WORDS, show_empty=True)
