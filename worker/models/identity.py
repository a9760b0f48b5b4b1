"""``identity``: outputs = inputs, no device work. Measures the pipeline's own overhead."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from worker.models.base import Options, parse_options
from worker.models.inputs import IdentityInput


class IdentityModel:
    name: ClassVar[str] = "identity"
    version: ClassVar[str] = "1"
    input_type: ClassVar[Any] = IdentityInput
    output_type: ClassVar[Any] = Any
    uses_torch: ClassVar[bool] = False  # the engine skips autocast/inference_mode for it

    def __init__(self, **options: Any) -> None:
        parse_options(options, Options, self.name)

    def setup(self, device: str) -> None:
        pass

    def decode(self, inputs: Any) -> Any:
        return inputs

    def collate(self, items: Sequence[Any]) -> list[Any]:
        return list(items)

    def forward(self, batch: list[Any]) -> list[Any]:
        return batch

    def split(self, output: list[Any], n: int) -> list[Any]:
        return output

    def example_inputs(self) -> list[Any]:
        return [{"x": 1.0}, "text", [1, 2, 3]]
