"""The loop: the runner, one room per kind of state (partitions, lifecycle, delivery, dispatch, results,
...), and the services only the loop uses (intake, the store gate, the generation worker)."""
