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
