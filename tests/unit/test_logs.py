from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from worker.observability.logs import is_secret_key, redact, redact_text, setup_logging


@pytest.fixture
def capture() -> Iterator[tuple[io.StringIO, logging.Logger]]:
    root = logging.getLogger()
    level, handlers = root.level, list(root.handlers)
    buf = io.StringIO()
    yield buf, logging.getLogger("worker.test")
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)


def lines(buf: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in buf.getvalue().splitlines()]


def test_json_lines_carry_base_fields_and_extras(capture: tuple[io.StringIO, logging.Logger]) -> None:
    buf, log = capture
    setup_logging("INFO", "json", stream=buf)
    log.info("committed %d offsets", 3, extra={"topic": "req", "partition": 1, "offset": 42, "level": "x"})
    log.debug("not shown")
    (line,) = lines(buf)
    assert line["level"] == "INFO" and line["logger"] == "worker.test"
    assert line["msg"] == "committed 3 offsets"
    assert (line["topic"], line["partition"], line["offset"]) == ("req", 1, 42)
    assert line["x_level"] == "x"  # colliding extras keep the base field intact
    assert line["ts"].endswith("Z") and "T" in line["ts"]


def test_exceptions_are_one_json_line(capture: tuple[io.StringIO, logging.Logger]) -> None:
    buf, log = capture
    setup_logging("INFO", "json", stream=buf)
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        log.exception("failed")
    (line,) = lines(buf)
    assert "RuntimeError: boom" in line["exc"]


def test_secrets_are_redacted(capture: tuple[io.StringIO, logging.Logger]) -> None:
    buf, log = capture
    setup_logging("INFO", "json", stream=buf)
    log.warning("connecting to %s", "redis://:hunter2@cache:6379/0", extra={
        "password": "hunter2", "sasl_password": "hunter2", "api-token": "hunter2",
        "props": {"sasl.jaas.config": "hunter2", "bootstrap.servers": "b:9092"},
        "url": "rediss://user:hunter2@cache:6380", "attempt": 2,
    })
    raw = buf.getvalue()
    assert "hunter2" not in raw
    (line,) = lines(buf)
    assert line["password"] == line["sasl_password"] == line["api-token"] == "***"
    assert line["props"] == {"sasl.jaas.config": "***", "bootstrap.servers": "b:9092"}
    assert line["url"] == "rediss://user:***@cache:6380"
    assert line["msg"] == "connecting to redis://:***@cache:6379/0"
    assert line["attempt"] == 2


class ConnectError(Exception):
    pass


@pytest.mark.parametrize("fmt", ["json", "text"])
def test_secrets_in_exceptions_and_odd_places_are_redacted(capture: tuple[io.StringIO, logging.Logger],
                                                           fmt: str) -> None:
    """An error message quoting a URL with credentials reached the log: as a %s argument, as an extra, in a
    traceback (all become text only in the formatter). So did a password containing "@", and a secret key
    nested more than 4 levels deep."""
    buf, log = capture
    setup_logging("INFO", fmt, stream=buf)
    err = ConnectError("cannot connect redis://:hunter2@cache:6379/0")
    log.warning("failed: %s", err, extra={"err": err,
                                          "deep": {"a": {"b": {"c": {"d": {"e": {"password": "x1"}}}}}}})
    try:
        raise err
    except ConnectError:
        log.exception("giving up")
    log.warning("url %s", "redis://:p@ss-hunter2@cache:6379/0")
    raw = buf.getvalue()
    assert "hunter2" not in raw and "x1" not in raw and "redis://:***@cache:6379/0" in raw


def test_payloads_only_at_debug(capture: tuple[io.StringIO, logging.Logger]) -> None:
    buf, log = capture
    setup_logging("DEBUG", "json", stream=buf)
    log.info("decoded", extra={"record_id": "r1", "payload": b"PRIVATE-DATA", "inputs": {"text": "PRIVATE"}})
    log.debug("decoded", extra={"record_id": "r1", "payload": b"debug-bytes"})
    info, debug = lines(buf)
    assert "PRIVATE" not in json.dumps(info)
    assert info["payload"] == "<omitted: 12 bytes>" and info["inputs"] == "<omitted: dict of 1>"
    assert info["record_id"] == "r1"
    assert debug["payload"] == "debug-bytes"


def test_text_format_and_reconfiguration(capture: tuple[io.StringIO, logging.Logger]) -> None:
    buf, log = capture
    setup_logging("INFO", "json", stream=io.StringIO())
    setup_logging("WARNING", "text", stream=buf)  # replaces the previous handler, does not add a second one
    log.info("hidden")
    log.warning("lag high", extra={"lag": 10, "token": "t0ps3cret"})
    out = buf.getvalue()
    assert out.count("\n") == 1
    assert "WARNING" in out and "worker.test: lag high" in out and "lag=10" in out and "t0ps3cret" not in out
    ours = [h for h in logging.getLogger().handlers if getattr(h, "_kiw_handler", False)]
    assert len(ours) == 1


def test_setup_validates_arguments() -> None:
    with pytest.raises(ValueError, match="logging level"):
        setup_logging("LOUD")
    with pytest.raises(ValueError, match="logging format"):
        setup_logging("INFO", "xml")


def test_helpers() -> None:
    assert is_secret_key("SASL_PASSWORD") and is_secret_key("ssl.key.password") and not is_secret_key("topic")
    assert redact("x", ["redis://a:b@h"]) == ["redis://a:***@h"]
    assert redact_text("no creds here") == "no creds here"
