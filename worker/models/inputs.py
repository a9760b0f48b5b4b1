"""Request ``inputs`` types of the built-in handlers.

Kept free of torch/transformers imports: ``schemas.export`` reads them to write
``schemas/models/<name>.request.schema.json`` without loading any model.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

TINY_DIM = 16
TINY_CLASSES = 4
MAX_TEXT_CHARS = 100_000

IdentityInput = Any
SyntheticInput = Any
TinyInput = Annotated[
    list[float],
    msgspec.Meta(min_length=TINY_DIM, max_length=TINY_DIM, description=f"{TINY_DIM} features"),
]


class TextInput(msgspec.Struct, kw_only=True, frozen=True):
    """One text to embed. Longer texts are truncated to the model's token limit (256 for minilm)."""

    text: Annotated[str, msgspec.Meta(max_length=MAX_TEXT_CHARS)]


Embedding = Annotated[list[float], msgspec.Meta(description="L2-normalised sentence embedding")]
Scores = Annotated[list[float], msgspec.Meta(description="class probabilities")]

MAX_STOP_CHARS = 1000
Probability = Annotated[float, msgspec.Meta(gt=0, le=1)]


class GenerateInput(msgspec.Struct, kw_only=True, frozen=True):
    """One generation request (generative handlers). The worker checks ``max_new_tokens`` and ``stop``
    against ``model.generation``'s limits; an omitted ``max_new_tokens`` is its ``default_max_new_tokens``."""

    prompt: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_TEXT_CHARS)]
    max_new_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=100, description="0: greedy")] = 0.0
    top_p: Probability = 1.0
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None = None
    stop: list[Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_STOP_CHARS)]] = msgspec.field(
        default_factory=list)


FinishReason = Annotated[str, msgspec.Meta(
    description="eos | stop | length (max_new_tokens) | context (the model's limit) | deadline | error")]


class GenerationOutput(msgspec.Struct, kw_only=True, frozen=True):
    """A finished (or, with status ``expired``, stopped) sequence: what it generated so far."""

    text: str
    token_ids: list[int]
    prompt_tokens: int
    generated_tokens: int
    finish_reason: FinishReason
    ttft_ms: float | None = None  # receipt -> first token; None when it got none
