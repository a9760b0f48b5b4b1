"""The runner's loop, one room per kind of state: partitions, lifecycle, delivery, dispatch, results."""
