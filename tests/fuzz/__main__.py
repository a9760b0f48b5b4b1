"""``python -m tests.fuzz --seconds N [--target NAME]``: run each fuzz target (or one) for N seconds and
report the inputs tried and the failures found. Exit 0 when none failed, 1 otherwise."""

from __future__ import annotations

import argparse
import sys
import time
import traceback

from hypothesis import HealthCheck, given, settings

from tests.fuzz.targets import TARGETS

BATCH = 500  # examples per hypothesis run; runs repeat until the time is up


def run_target(name: str, seconds: float) -> tuple[int, list[str]]:
    target = TARGETS[name]
    tried = 0
    failures: list[str] = []

    def counted(args: tuple[object, ...]) -> None:
        nonlocal tried
        tried += 1
        target.check(*args)

    test = settings(max_examples=BATCH, deadline=None, database=None, print_blob=True,
                    suppress_health_check=list(HealthCheck))(given(target.strategy())(counted))
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            test()
        except Exception:  # noqa: BLE001 - a failure found: reported (with the shrunk example), then on
            failures.append(traceback.format_exc(limit=8))
            break  # hypothesis would find the same one again
    return tried, failures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    p.add_argument("--seconds", type=float, default=60.0, help="time per target (default 60)")
    p.add_argument("--target", choices=sorted(TARGETS), default=None, help="only this target (default: all)")
    args = p.parse_args(argv)
    names = [args.target] if args.target else list(TARGETS)
    failed = 0
    for name in names:
        t0 = time.monotonic()
        tried, failures = run_target(name, args.seconds)
        took = time.monotonic() - t0
        print(f"fuzz {name}: {tried} inputs in {took:.0f} s ({tried / took if took else 0:.0f}/s), "
              f"{len(failures)} failures", flush=True)
        for f in failures:
            print(f, file=sys.stderr)
        failed += bool(failures)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
