"""The engine's out-of-memory adaptation lowers a lane's token budget, not only its count: a batch whose
records cost more than the device holds is rerun in chunks within both limits, the scheduler is told the
budget (``on_tokens``), and successes put the configured budget back."""

from __future__ import annotations

from typing import Any

import torch

from tests.unit.fakes_kafka import FakeModel
from worker.device.engine import Engine


class TokenHungry(FakeModel):
    """Items are their own cost (ints); a forward over ``room`` total cost runs out of memory."""

    uses_torch = False

    def __init__(self, room: int | None) -> None:
        super().__init__()
        self.room = room

    def size_of(self, item: Any) -> int:
        return int(item)

    def forward(self, batch: list[Any]) -> list[Any]:
        if self.room is not None and sum(batch) > self.room:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (test)")
        return super().forward(batch)


def test_an_oom_lowers_the_token_budget_and_chunks_by_it() -> None:
    m = TokenHungry(room=130)
    budgets: list[tuple[str, int | None]] = []
    counts: list[int] = []
    eng = Engine(m, "cpu", warmup=False, grow_after=5, grow_factor=2.0, max_batch_sizes={"a": 16},
                 max_batch_tokens={"a": 400}, on_limit=lambda lane, n: counts.append(n),
                 on_tokens=lambda lane, t: budgets.append((lane, t)))
    items = [50, 50, 50, 50, 10, 10, 10, 10]  # 240 in all, one batch of 8 records
    assert eng.infer(items, "a") == items  # every record, in order
    assert budgets == [("a", 120)] and counts == [4]  # both halved
    assert eng.stats.oom == 1
    assert m.forward_calls == [[50, 50], [50, 50, 10, 10], [10, 10]]  # chunks within 4 records and 120
    m.room = None  # memory frees up: successes bring the configured budget back
    for _ in range(20):
        eng.infer(items, "a")
    assert eng._limits.effective_tokens("a") == 400 and budgets[-1] == ("a", 400)
    assert eng.effective_max("a") is None


def test_a_lane_without_a_budget_gets_one_and_loses_it_when_lifted() -> None:
    m = TokenHungry(room=30)
    budgets: list[int | None] = []
    eng = Engine(m, "cpu", warmup=False, grow_after=1, grow_factor=4.0,
                 on_tokens=lambda lane, t: budgets.append(t))
    assert eng.infer([20, 20, 20], "b") == [20, 20, 20]
    assert budgets and budgets[0] is not None and budgets[0] < 60
    m.room = None
    for _ in range(20):
        eng.infer([20, 20, 20], "b")
    assert budgets[-1] is None and eng._limits.effective_tokens("b") is None
