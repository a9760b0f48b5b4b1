"""A short run of each fuzz target (tests/fuzz/targets.py) in ``make test``; ``make fuzz`` runs them longer.
The ``@example`` inputs are the failures fuzzing found, kept as regressions."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings

from schemas import DeadLetter
from tests.fuzz import target_config, target_dlq, target_intake

SMOKE = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.data_too_large])


def _letter(topic: bytes, stage: bytes = b"decode",
            error: bytes = b"undecodable json") -> list[tuple[str, bytes]]:
    good = DeadLetter(error="e", error_stage="decode", source_topic="in", source_partition=0, source_offset=1)
    out = dict(good.headers())
    out.update({"x-source-topic": topic, "x-error-stage": stage, "x-error": error})  # type: ignore[dict-item]
    return list(out.items())  # type: ignore[arg-type]


@pytest.mark.parametrize("fmt", ["json", "msgpack"])
def test_intake_smoke(fmt: str) -> None:
    @SMOKE
    @given(target_intake.records(fmt))
    def run(args: tuple[bytes | None, bytes | None, list[tuple[str, bytes]], str]) -> None:
        target_intake.check(fmt, *args)

    run()


@SMOKE
@given(target_config.yaml_bytes())
# A NUL (or another control character) in the file: PyYAML's reader refused it in the loader's constructor,
# outside the error handling, and check-config / run ended with a traceback (exit 1) instead of exit 2.
@example(b"\x00")
@example(b"kafka: {input_topics: [in]}\n\x1b[2J")
# PyYAML raised ValueError / OverflowError / AttributeError (not YAMLError) for these values: a traceback and
# exit 1. Found by `make fuzz` (config, 5 min): the two escapes; the others are of the same kind.
@example(b'batching: "\\U0A0010000"\nkafka:\n  input_topics:\n  - in\n')
@example(b'batching: "\\UA00010000"\nkafka:\n  input_topics:\n  - in\n')
@example(b"kafka: {input_topics: [in]}\nmodel: {version: 2024-13-45}")
@example(b"kafka: {input_topics: [in]}\nmodel: {version: !!timestamp x}")
@example(b"kafka: {input_topics: [in]}\nmodel: {version: !!int 0x}")
def test_config_smoke(data: bytes) -> None:
    target_config.check(data)


@SMOKE
@given(target_dlq.dead_letters())
# A dead letter naming a source topic with a NUL: produce() raised ValueError and replay stopped with a
# traceback, on the same dead letter at every run. Now skipped and listed, as any non-topic name.
@example((_letter(b"in\x00x"), b"{}", None))
@example((_letter(b"bad topic"), b"{}", None))
# Header text with terminal escape sequences is escaped in what replay prints (--dry-run, skip lines).
@example((_letter(b"in", error=b"\x1b]0;owned\x07\x1b[2J"), b"{}", None))
@example((_letter(b"\x1b[2J"), b"{}", None))
def test_dlq_smoke(args: tuple[list[tuple[str, bytes | None]] | None, bytes | None, str | None]) -> None:
    target_dlq.check(*args)


def test_dlq_replay_lines_escape_control_characters() -> None:
    from worker.app.dlq import examine

    seen = examine(_letter(b"\x1b[2Jevil"), b"{}", None)
    assert seen.skip is not None and "\x1b" not in seen.skip and "\\x1b[2Jevil" in seen.skip
