"""Helpers shared by the tests of tests/unit, tests/e2e and tests/gpu (``from support.<module> import ...``: the
tests' conftest.py puts tests/ on the import path)."""
