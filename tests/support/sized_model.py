"""A handler for token-budget tests: ``identity`` whose records cost ``inputs["n"]`` and that refuses
records over ``max_size`` (config ``model.name: tests.support.sized_model:make``). Each output carries its
batch's total cost, so a test reads back what every batch cost."""

from __future__ import annotations

from typing import Any

from worker.models.identity import IdentityModel


class SizedModel(IdentityModel):
    max_size = 150

    def size_of(self, item: Any) -> int:
        return int(item["n"])

    def forward(self, batch: list[Any]) -> list[Any]:
        total = sum(int(x["n"]) for x in batch)
        return [{**x, "batch_cost": total} for x in batch]


def make(**options: Any) -> SizedModel:
    return SizedModel(**options)
