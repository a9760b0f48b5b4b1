"""The error every config problem becomes: one message per problem, sorted by the key path it names."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from worker.config.settings import ModelConfig


class ConfigError(ValueError):
    """Configuration problems: one message per line, sorted by the key path each starts with, naming what was
    expected. ``problems`` holds the messages; ``model`` the model section, when it validated (check-config
    checks the model even where other sections are wrong)."""

    def __init__(self, problems: str | list[str], model: ModelConfig | None = None) -> None:
        self.problems = [problems] if isinstance(problems, str) else sorted(dict.fromkeys(problems),
                                                                            key=_path_key)
        self.model = model
        super().__init__("\n".join(self.problems))


def _path_key(problem: str) -> tuple[str, str]:
    """Sorts ``$.a.b[2]: ...`` messages by path: list indexes in numeric order."""
    path = problem.split(": ", 1)[0]
    return re.sub(r"\[(\d+)\]", lambda m: f"[{int(m.group(1)):09d}]", path), problem
