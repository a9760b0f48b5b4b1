"""Logging setup: JSON lines (default) or plain text on stderr, with secrets redacted.

JSON line fields: ``ts`` (UTC, ISO 8601, ms), ``level``, ``logger``, ``msg``, every field passed with
``extra={...}``, and ``exc`` when there is a traceback. Extra fields that collide with those names are
written with an ``x_`` prefix.

What gets logged where (a rule for every module, enforced where cheap):

- At INFO and above the worker logs identifiers only: record ids, topic/partition/offset, lane, batch sizes,
  timings. Never request or result content.
- Payloads (inputs, outputs, raw bytes) only at DEBUG. Extra fields named ``payload``, ``inputs``,
  ``outputs``, ``body`` or ``raw`` on a record above DEBUG are replaced by ``<omitted: ...>``.
- Secrets never: values of extra fields whose key looks secret (password, secret, token, sasl, credential,
  api key, authorization, private key), also inside nested dicts, become ``***``; credentials in URLs
  (``redis://:pw@host``) in extra values, in the message and in its arguments become ``***``.
"""

from __future__ import annotations

import datetime as _dt
import json
import logging
import re
import sys
from collections.abc import Mapping
from typing import IO, Any

__all__ = ["JsonFormatter", "LibrdkafkaLog", "RedactingFilter", "TextFormatter", "is_secret_key", "redact",
           "redact_text", "setup_logging"]

SECRET_KEY_WORDS = ("password", "passwd", "secret", "token", "sasl", "credential", "api_key", "apikey",
                    "authorization", "private_key", "privatekey", "key_pem")
PAYLOAD_FIELDS = frozenset({"payload", "inputs", "outputs", "body", "raw"})
REDACTED = "***"

# The password runs to the last "@" before the host (greedy, then backtracking): one may contain "@".
_URL_CREDS = re.compile(r"([a-zA-Z][a-zA-Z0-9+.-]*://[^:/@\s]*):([^/\s]+)@")
# ...and a secret passed as a URL query parameter (redis-py reads redis://host/0?password=...).
_URL_QUERY_SECRET = re.compile(r"([?&][^=&\s]*(?:password|passwd|secret|token)[^=&\s]*=)[^&#\s]+",
                               re.IGNORECASE)
_RESERVED = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {"message", "asctime",
                                                                                 "taskName"}
_BASE_FIELDS = ("ts", "level", "logger", "msg")
_MARK = "_kiw_handler"


def is_secret_key(key: str, words: tuple[str, ...] = SECRET_KEY_WORDS) -> bool:
    """Whether ``key`` names a secret: it contains one of ``words``, with "-" and "." read as "_" (x-api-key,
    API.KEY, sasl.oauthbearer.config)."""
    k = key.lower().replace("-", "_").replace(".", "_")
    return any(w in k for w in words)


def redact_text(text: str) -> str:
    """Mask the password part of ``scheme://user:password@host`` URLs, and secret query parameters
    (``?password=...``)."""
    if "@" in text:
        text = _URL_CREDS.sub(rf"\1:{REDACTED}@", text)
    if "=" in text and ("?" in text or "&" in text):
        text = _URL_QUERY_SECRET.sub(rf"\1{REDACTED}", text)
    return text


def redact(key: str, value: Any, depth: int = 0, words: tuple[str, ...] = SECRET_KEY_WORDS,
           show_empty: bool = False) -> Any:
    """A copy of ``value`` safe to log under ``key``: values of secret keys (``words``) masked at any depth,
    URL credentials in strings masked. ``show_empty``: an empty secret stays visible as such."""
    if value is not None and not (show_empty and value == "") and is_secret_key(key, words):
        return REDACTED
    if depth > 16:
        return "<omitted: nested too deep to check for secrets>"
    if isinstance(value, str):
        return redact_text(value)
    if isinstance(value, Mapping):
        return {k: redact(str(k), v, depth + 1, words, show_empty) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [redact("", v, depth + 1, words, show_empty) for v in value]
    return value


def _extras(record: logging.LogRecord) -> list[str]:
    return [k for k in record.__dict__ if k not in _RESERVED and not k.startswith("_")]


def _describe(value: Any) -> str:
    if isinstance(value, bytes | bytearray | memoryview):
        return f"<omitted: {len(value)} bytes>"
    if isinstance(value, str):
        return f"<omitted: {len(value)} chars>"
    if isinstance(value, list | tuple | dict):
        return f"<omitted: {type(value).__name__} of {len(value)}>"
    return f"<omitted: {type(value).__name__}>"


class RedactingFilter(logging.Filter):
    """Masks the values of secret-looking keys in extra fields and mapping args; drops payload fields above
    DEBUG. URL credentials anywhere in the line are masked by the formatters, on the finished text."""

    def filter(self, record: logging.LogRecord) -> bool:
        for key in _extras(record):
            value = record.__dict__[key]
            if key in PAYLOAD_FIELDS and record.levelno > logging.DEBUG:
                record.__dict__[key] = _describe(value)
            else:
                record.__dict__[key] = redact(key, value)
        if isinstance(record.args, Mapping):
            record.args = {k: redact(str(k), v) for k, v in record.args.items()}
        return True


def _json_default(value: Any) -> Any:
    if isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
        return data[:256].decode("utf-8", "replace") + ("..." if len(data) > 256 else "")
    if isinstance(value, set | frozenset):
        return sorted(value, key=str)
    return str(value)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        ts = _dt.datetime.fromtimestamp(record.created, tz=_dt.timezone.utc)
        out: dict[str, Any] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key in _extras(record):
            out[f"x_{key}" if key in _BASE_FIELDS else key] = record.__dict__[key]
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        # Last pass over the whole line: exceptions in args or extras, and tracebacks, become text only here,
        # after RedactingFilter ran (an error message may quote a URL with credentials).
        return redact_text(json.dumps(out, default=_json_default, ensure_ascii=False))


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = " ".join(f"{k}={record.__dict__[k]!r}" for k in _extras(record))
        if not extras:
            return redact_text(line)  # (see JsonFormatter: exceptions and tracebacks become text only here)
        head, sep, tail = line.partition("\n")  # keep a traceback below the first line
        return redact_text(f"{head} {extras}{sep}{tail}")


# librdkafka logs these at WARNING while it retries them itself, and they clear within seconds of a broker's
# start (a coordinator loading its partitions): INFO, not a warning a reader should act on.
LIBRDKAFKA_TRANSIENT = ("Coordinator load in progress", "COORDINATOR_LOAD_IN_PROGRESS")
_THREAD = re.compile(r"\[thrd:([^\]]*)\]: ", re.S)


class LibrdkafkaLog:
    """librdkafka's own log lines as records of the worker's logging, for confluent-kafka's ``logger`` client
    property (which calls ``log(level, "%s [%s] %s", facility, client, text)``, the level already mapped from
    syslog: 3 ERROR, 4 WARNING, 5 and 6 INFO, 7 DEBUG). The record's message is librdkafka's text; the
    facility (``GETPID``, ``FAIL``...), the client's name and librdkafka's thread are fields of their own."""

    def __init__(self, name: str) -> None:
        self.logger = logging.getLogger(name)

    def log(self, level: int, fmt: str, *args: Any) -> None:
        if len(args) != 3:  # not librdkafka's form: as given
            self.logger.log(level, fmt, *args)
            return
        facility, client, text = (str(a) for a in args)
        thread = ""
        m = _THREAD.match(text)
        if m:
            thread, text = m.group(1), text[m.end():]
        if level > logging.INFO and any(t in text for t in LIBRDKAFKA_TRANSIENT):
            level = logging.INFO
        if self.logger.isEnabledFor(level):
            self.logger.log(level, "%s", text, extra={"facility": facility, "client": client,
                                                      "rdkafka_thread": thread})


def setup_logging(level: str = "INFO", fmt: str = "json", stream: IO[str] | None = None) -> logging.Handler:
    """Configure the root logger once (calling again replaces the handler it installed before)."""
    lvl = logging.getLevelName(level.upper())
    if not isinstance(lvl, int):
        raise ValueError(f"logging level must be DEBUG, INFO, WARNING or ERROR, got {level!r}")
    if fmt.lower() not in ("json", "text"):
        raise ValueError(f"logging format must be 'json' or 'text', got {fmt!r}")
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt.lower() == "json" else TextFormatter())
    handler.addFilter(RedactingFilter())
    setattr(handler, _MARK, True)
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _MARK, False)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(lvl)
    return handler
