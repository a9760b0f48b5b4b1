"""The ``minilm`` handler with a forward that costs nothing: what the host path alone can deliver.

Load it as a factory: ``model.name: tests.bench.null_device:null_minilm``. Decoding, collating and splitting
are the real handler's; ``forward`` returns zeros of the right shape, so the device is never the ceiling.
"""

from __future__ import annotations

from typing import Any

import torch

from worker.models.minilm import DIM, MiniLMModel


class NullDeviceMiniLM(MiniLMModel):
    """``minilm`` whose forward returns ``zeros(n, 384)`` and whose setup loads no weights."""

    def setup(self, device: str) -> None:
        self.device = device

    def forward(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.zeros(batch["input_ids"].shape[0], DIM)


def null_minilm(**options: Any) -> NullDeviceMiniLM:
    return NullDeviceMiniLM(**options)
