"""Hypothesis profiles: how hard the property tests search.

Each property test names its example count at the ``dev`` profile through ``examples(n)``; the loaded
profile scales every count by the same factor, so a test's weight relative to the others stays as written:

- ``dev`` (default): each test's own count, a few seconds for the whole unit suite;
- ``ci`` (``.ci/run`` sets ``KIW_HYPOTHESIS_PROFILE=ci``): 20x, a few minutes on a 2-core machine;
- ``soak``: 1000x (50x ``ci``), for a long local run, e.g.
  ``KIW_HYPOTHESIS_PROFILE=soak python -m pytest tests/unit -p no:cacheprovider --hypothesis-seed=1``.

Every profile prints the blob that reproduces a failure (``print_blob``), so a failure in CI can be replayed
with ``@reproduce_failure`` and then kept as an ``@example``.
"""

from __future__ import annotations

import os

from hypothesis import settings

PROFILE_ENV = "KIW_HYPOTHESIS_PROFILE"
SCALE = {"dev": 1, "ci": 20, "soak": 1000}
BASE = 100  # hypothesis's own max_examples: the dev profile keeps it


def load() -> str:
    """Register the profiles and load the one the environment names (unknown names are an error)."""
    for name, factor in SCALE.items():
        settings.register_profile(name, max_examples=BASE * factor, print_blob=True, deadline=None)
    name = os.environ.get(PROFILE_ENV, "dev").strip() or "dev"
    if name not in SCALE:
        raise ValueError(f"{PROFILE_ENV}={name!r}: expected one of {', '.join(SCALE)}")
    settings.load_profile(name)
    return name


def examples(n: int) -> int:
    """``n`` examples at the dev profile, scaled by the loaded profile."""
    return max(1, n * settings.default.max_examples // BASE)
