"""Fuzz targets on the worker's real code paths (hypothesis).

``python -m tests.fuzz --seconds N [--target NAME]`` runs each target for N seconds (``make fuzz``);
tests/fuzz/test_fuzz_smoke.py runs a short smoke of each in ``make test``. A failure found becomes a fixed
bug and an ``@example`` in the smoke test."""
