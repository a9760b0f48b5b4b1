"""The reused pinned host buffers of the CUDA copy path (``worker.device.pinned_pool``), on the CPU: plain
memory stands in for pinned memory, fake events for the copies' CUDA events."""

from __future__ import annotations

from typing import Any

import torch

from worker.device.pinned_pool import PinnedPool, capacity


class Copy:
    """A CUDA event stand-in: done once the test says so; ``synchronize`` finishes it."""

    def __init__(self) -> None:
        self.done = False
        self.waited = 0

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited += 1
        self.done = True


def pool(**kw: Any) -> PinnedPool:
    return PinnedPool(alloc=lambda n, dtype: torch.empty(n, dtype=dtype), **kw)


def batch(rows: int, cols: int) -> dict[str, torch.Tensor]:
    ids = torch.arange(rows * cols, dtype=torch.int64).reshape(rows, cols)
    return {"input_ids": ids, "attention_mask": torch.ones(rows, cols, dtype=torch.int64)}


def stage_all(p: PinnedPool, b: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Copy]:
    taken: list[Any] = []
    staged = {k: p.stage(v, taken) for k, v in b.items()}
    ev = Copy()
    p.release(taken, ev)
    return staged, ev


def test_capacity_rounds_up_to_a_power_of_two() -> None:
    assert [capacity(n) for n in (0, 1, 1024, 1025, 4096, 5000)] == [1024, 1024, 1024, 2048, 4096, 8192]


def test_a_staged_tensor_equals_its_source() -> None:
    p = pool()
    b = batch(8, 13)
    staged, _ = stage_all(p, b)
    for k in b:
        assert staged[k].shape == b[k].shape and staged[k].dtype == b[k].dtype
        assert torch.equal(staged[k], b[k])


def test_a_stream_of_nearby_shapes_reuses_its_buffers_once_their_copies_are_done() -> None:
    p = pool()
    for i in range(50):
        staged, ev = stage_all(p, batch(256, 20 + i % 7))  # padded to a different longest each time
        ev.done = True
        assert torch.equal(staged["input_ids"], batch(256, 20 + i % 7)["input_ids"])
    # One buffer per tensor of the batch (8192-element capacity for 256 x 20..26): allocated once.
    assert p.allocations == 2


def test_a_buffer_whose_copy_is_still_running_is_not_handed_out_again() -> None:
    p = pool()
    first, ev1 = stage_all(p, batch(4, 4))
    kept = first["input_ids"].clone()
    zeros = torch.zeros(4, 4, dtype=torch.int64)
    stage_all(p, {"input_ids": zeros, "attention_mask": zeros})
    assert torch.equal(first["input_ids"], kept)  # the running copy's source is untouched
    assert p.allocations == 4
    ev1.done = True
    stage_all(p, batch(4, 4))
    assert p.allocations == 4  # the first batch's buffers, free again


def test_past_per_key_the_oldest_copy_is_waited_for() -> None:
    p = pool(per_key=2)
    events = [stage_all(p, {"x": torch.ones(10)})[1] for _ in range(2)]
    assert p.allocations == 2
    stage_all(p, {"x": torch.ones(10)})
    assert p.allocations == 2 and events[0].waited == 1 and events[1].waited == 0


def test_the_pool_never_holds_more_than_max_bytes() -> None:
    p = pool(max_bytes=1024 * 8)  # one 1024-element int64 buffer
    for _ in range(3):
        stage_all(p, {"x": torch.ones(10, dtype=torch.int64)})  # copies never done: each needs a buffer
    assert p.held_bytes == 1024 * 8 and p.allocations == 3


def test_buffers_handed_out_in_one_batch_are_distinct_until_released() -> None:
    p = pool(per_key=1)
    taken: list[Any] = []
    a = p.stage(torch.ones(10), taken)
    b = p.stage(torch.full((10,), 2.0), taken)  # the key's one kept buffer is in use: a spare one
    assert a.data_ptr() != b.data_ptr() and float(a.sum()) == 10.0
    p.release(taken, Copy())
    assert taken == []
