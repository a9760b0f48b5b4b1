"""``tiny``: a small fixed-seed MLP (16 features -> 4 class probabilities). The demo's default model."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, ClassVar

import msgspec
import torch

from worker.models.base import Options, parse_options, split_rows
from worker.models.inputs import TINY_CLASSES, TINY_DIM, Scores, TinyInput

_F32_MAX = 3.4028234663852886e38  # the largest finite float32


class TinyOptions(Options):
    # 0 divided by zero, a negative one raised in torch
    hidden: Annotated[int, msgspec.Meta(ge=1, le=65_536)] = 64
    seed: int = 0


class TinyModel:
    name: ClassVar[str] = "tiny"
    input_type: ClassVar[Any] = TinyInput
    output_type: ClassVar[Any] = Scores

    def __init__(self, **options: Any) -> None:
        opts = parse_options(options, TinyOptions, self.name)
        self.version = f"1-h{opts.hidden}-s{opts.seed}"
        # A private generator: building the model must not disturb the global RNG.
        g = torch.Generator().manual_seed(opts.seed)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(TINY_DIM, opts.hidden), torch.nn.GELU(),
            torch.nn.Linear(opts.hidden, TINY_CLASSES)
        )
        with torch.no_grad():
            for p in self.net.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * (1.0 / p.shape[-1] ** 0.5))
        self.net.eval()

    def setup(self, device: str) -> None:
        self.net.to(device)

    def decode(self, inputs: list[float]) -> list[float]:
        # msgspec checks there are TINY_DIM floats; not that they are finite in float32: NaN or inf (msgpack
        # carries them) or a value past float32's range (inf once converted) gave NaN probabilities, sent as
        # nulls in an ok result. (A comparison is False for NaN.)
        if not all(-_F32_MAX <= v <= _F32_MAX for v in inputs):
            raise ValueError("inputs must be finite float32 values: got NaN, infinity or a "
                             "value beyond +-3.4e38")
        return inputs

    def collate(self, items: Sequence[list[float]]) -> torch.Tensor:
        return torch.tensor(items, dtype=torch.float32)

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.net(batch).float(), dim=-1)

    def split(self, output: torch.Tensor, n: int) -> list[Any]:
        return split_rows(output, n)

    def example_inputs(self) -> list[list[float]]:
        return [[((i * 7 + j) % 11) / 10.0 - 0.5 for j in range(TINY_DIM)] for i in range(8)]
