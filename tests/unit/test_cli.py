"""``worker`` command line: what --help promises, and options that change the config they run with."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from worker.app.cli import build_parser, main


def _help(*command: str) -> str:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return " ".join(sub.choices[command[0]].format_help().split())  # one line: wrapping varies with width


@pytest.mark.parametrize("command, wanted", [
    ("load", ["--rate RATE records per second (default 1000", "(default tiny)",
              "--deadline-ms MS give each request a deadline MS milliseconds after",
              "(default: no deadline)"]),
    ("profile", ["or a model file (default tiny)", "autocast dtype, as model.dtype (default fp32"]),
    ("demo", ["0 with --bootstrap or KAFKA_BOOTSTRAP_SERVERS"]),
    ("run", ["turns the endpoint on even where metrics.enabled is false"]),
    ("check-config", ["shown as ***"]),
])
def test_help_states_defaults_and_meanings(command: str, wanted: list[str]) -> None:
    text = _help(command)
    for w in wanted:
        assert w in text, f"{command} --help lacks {w!r}:\n{text}"


def test_metrics_port_turns_the_metrics_endpoint_on(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import worker.app.service

    seen: list[tuple[Any, int | None]] = []
    monkeypatch.setattr(worker.app.service, "run_service",
                        lambda cfg, metrics_port=None: seen.append((cfg, metrics_port)) or 0)
    monkeypatch.setattr("worker.app.cli._setup_logging", lambda cfg, level=None: None)
    f = tmp_path / "c.yaml"
    f.write_text("kafka: {input_topics: [in]}\nmetrics: {enabled: false, port: 9400}\n")
    assert main(["run", "--config", str(f)]) == 0
    assert main(["run", "--config", str(f), "--metrics-port", "0"]) == 0
    (off, no_port), (on, port) = seen
    assert (off.metrics.enabled, no_port) == (False, None)  # no flag: the file decides
    assert (on.metrics.enabled, port) == (True, 0)
