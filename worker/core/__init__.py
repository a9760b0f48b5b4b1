"""Pure logic: no kafka / torch / redis / prometheus imports; time comes in as ``now`` (monotonic seconds).

tests/unit/test_core_purity.py enforces the import rule.
"""
