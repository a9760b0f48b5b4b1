"""The kill -9 test's account of duplicates (tests/chaos/kill_windows.py), on made-up results."""

from __future__ import annotations

from typing import Any

from tests.chaos.kill_windows import Copy, copies, unexplained, windows

KILLS = [100.0, 200.0]  # wall-clock seconds of two kills: processes 0, 1, 2


def result(rid: str, partition: int, offset: int) -> dict[str, Any]:
    return {"id": rid, "source": {"partition": partition, "offset": offset}}


def account(results: list[tuple[str, int, int, float]]) -> dict[str, list[Copy]]:
    """(id, partition, offset, produced at in seconds) -> copies by process."""
    by_id: dict[str, list[dict[str, Any]]] = {}
    stamps: dict[str, list[int]] = {}
    for rid, p, o, t in results:
        by_id.setdefault(rid, []).append(result(rid, p, o))
        stamps.setdefault(rid, []).append(int(t * 1000))
    return copies(by_id, stamps, KILLS)


def test_a_result_belongs_to_the_process_alive_when_it_was_produced() -> None:
    by_copy = account([("a", 0, 5, 99.999), ("a", 0, 5, 101.5), ("b", 0, 6, 250.0)])
    assert [c.process for c in by_copy["a"]] == [0, 1]
    assert [c.process for c in by_copy["b"]] == [2]


def test_a_second_result_at_or_past_the_commit_the_kill_left_is_explained() -> None:
    committed = [{0: 5}, {0: 9}]
    by_copy = account([("a", 0, 5, 99.0), ("a", 0, 5, 150.0), ("c", 0, 9, 150.0), ("c", 0, 9, 250.0)])
    assert unexplained(by_copy, committed) == []
    assert windows(by_copy, committed) == [{0: (5, 6)}, {0: (9, 10)}]


def test_a_second_result_below_that_commit_is_not() -> None:
    committed = [{0: 5}, {0: 9}]
    by_copy = account([("a", 0, 4, 99.0), ("a", 0, 4, 150.0)])
    assert unexplained(by_copy, committed) == [
        ("a", "process 1 produced 0@4 again, below the commit 5 that kill 1 left")]


def test_two_results_from_one_process_are_not_explained_by_any_window() -> None:
    committed = [{0: -1001}, {0: -1001}]  # no commit: every offset lies in the windows
    by_copy = account([("a", 0, 0, 150.0), ("a", 0, 0, 160.0)])
    assert unexplained(by_copy, committed) == [("a", "process 1 produced it twice (0@0)")]


def test_a_result_that_reached_the_broker_late_still_counts_for_its_kill() -> None:
    """Stamped before the kill: it widens that kill's window whenever the reader saw it."""
    by_copy = account([("a", 0, 7, 99.9), ("a", 0, 7, 130.0)])
    assert windows(by_copy, [{0: 7}, {0: 8}]) == [{0: (7, 8)}, {0: (8, 8)}]
    assert unexplained(by_copy, [{0: 7}, {0: 8}]) == []
