"""What the iteration-level scheduler asks of a generative model: one decode step over the active sequences.

A sequence is started once (its prompt is known), stepped until the scheduler decides it is finished (EOS,
``max_new_tokens``, a stop string, a deadline), and released. Each ``step`` runs one forward over every
sequence it is given: the prompt (prefill) for a sequence not stepped before, one token for the others. The
model keeps each sequence's cache; the scheduler keeps everything else (slots, budgets, lanes, finish rules).

Every method runs on the one device thread that owns the model; none is called concurrently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import msgspec


class GenParams(msgspec.Struct, frozen=True, kw_only=True):
    """One sequence's sampling settings, already validated against the configured limits."""

    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None  # None: the sequence's id seeds its generator (reproducible per record)
    stop: tuple[str, ...] = ()


@runtime_checkable
class StepModel(Protocol):
    """A causal LM seen one step at a time."""

    @property
    def eos_token_id(self) -> int | None: ...

    @property
    def max_context(self) -> int: ...  # prompt + generated tokens a sequence may reach

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def start(self, seq_id: int, prompt_ids: Sequence[int], params: GenParams) -> None:
        """Registers a sequence; its prefill runs in the next ``step`` that includes it."""
        ...

    def step(self, seq_ids: Sequence[int]) -> list[int]:
        """One forward over ``seq_ids`` (started, not released): the next token of each, in order."""
        ...

    def release(self, seq_id: int) -> None:
        """Frees the sequence's cache; the id may be reused after."""
        ...


@runtime_checkable
class GenerativeHandler(Protocol):
    """A handler for a generative model: the runner gives it a generation worker instead of a batch one.

    ``setup(device)`` loads the weights; ``step_model()`` then returns the model the scheduler steps.
    """

    kind: str  # "generative"

    @property
    def name(self) -> str: ...

    @property
    def version(self) -> str: ...

    def setup(self, device: str) -> None: ...

    def step_model(self) -> StepModel: ...
