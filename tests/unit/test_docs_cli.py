"""docs/cli.md documents every subcommand of `worker` and every flag of each, in the subcommand's section."""

from __future__ import annotations

import argparse
import re

from tests.support.doc_blocks import ROOT
from worker.app.cli import build_parser

PAGE = (ROOT / "docs" / "cli.md").read_text()


def _commands(parser: argparse.ArgumentParser, prefix: str = "worker") -> dict[str, argparse.ArgumentParser]:
    out = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                nested = _commands(sub, f"{prefix} {name}")
                out.update(nested or {f"{prefix} {name}": sub})
    return out


def _section(title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", PAGE, re.M | re.S)
    assert m, f"docs/cli.md has no section '## {title}'"
    return m.group(1)


def test_every_subcommand_and_flag_is_documented() -> None:
    commands = _commands(build_parser())
    assert {"worker run", "worker check-config", "worker predict", "worker dlq replay"} <= set(commands)
    for title, sub in commands.items():
        text = _section(title)
        for action in sub._actions:
            for flag in action.option_strings:
                if flag in ("-h", "--help"):
                    continue
                assert f"`{flag}" in text, f"docs/cli.md '## {title}' does not document {flag}"
        assert "Exit codes:" in text, f"docs/cli.md '## {title}' does not give its exit codes"


def test_the_global_flags_are_documented() -> None:
    text = _section("Global flags")
    assert "`--version`" in text and "`--help`" in text
