"""Benchmarks (``make bench`` = ``python -m tests.bench.run_all``). Not pytest tests: they never assert on
time; they print a table of ratios against baselines measured in the same run and write docs/bench/."""
