"""Every family through a real PD stack takes minutes: `make test` starts the stacks of
STACK_FAMILIES only, `make test-families` (KVRELAY_FAMILY_STACKS=1) all of them."""
from __future__ import annotations

import os

import pytest

STACK_FAMILIES = ("gemma3", "qwen3_moe")  # windows, sandwich norms, q/k norms; experts


def pytest_collection_modifyitems(config, items) -> None:
    if os.environ.get("KVRELAY_FAMILY_STACKS") == "1":
        return
    skip = pytest.mark.skip(reason="runs with `make test-families` (KVRELAY_FAMILY_STACKS=1)")
    for item in items:
        callspec = getattr(item, "callspec", None)
        if (item.get_closest_marker("family_stack") is not None and callspec is not None
                and callspec.params.get("stack_family") not in STACK_FAMILIES):
            item.add_marker(skip)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "family_stack: a family served by a real PD stack")
