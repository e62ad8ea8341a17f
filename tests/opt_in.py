"""Suites too long for `make test` (chaos, fuzz, compose) run only when their variable is 1;
each one's conftest calls `skip_unless_enabled` from pytest_collection_modifyitems."""
from __future__ import annotations

import os

import pytest


def skip_unless_enabled(items, variable: str, directory: str, make_target: str) -> None:
    """Mark every test under `directory` (e.g. "tests/chaos/") skipped unless $variable is 1."""
    if os.environ.get(variable) == "1":
        return
    skip = pytest.mark.skip(reason=f"runs with `make {make_target}` ({variable}=1)")
    for item in items:
        if directory in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)
