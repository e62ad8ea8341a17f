"""Every family through a real PD stack takes minutes, and every GGUF twin a quarter of one:
`make test` starts the stacks of STACK_FAMILIES and converts the twins of GGUF_FAMILIES only,
`make test-families` (KVRELAY_FAMILY_STACKS=1) all of them."""
from __future__ import annotations

import os

import pytest

STACK_FAMILIES = ("gemma3", "qwen3_moe")  # windows, sandwich norms, q/k norms; experts
GGUF_FAMILIES = ("gemma3",)  # a non-Llama family; the default model is Llama's GGUF


def pytest_collection_modifyitems(config, items) -> None:
    if os.environ.get("KVRELAY_FAMILY_STACKS") == "1":
        return
    skip = pytest.mark.skip(reason="runs with `make test-families` (KVRELAY_FAMILY_STACKS=1)")
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if (item.get_closest_marker("family_stack") is not None
                and params.get("stack_family") not in STACK_FAMILIES):
            item.add_marker(skip)
        if "twin" in params and params["twin"] not in GGUF_FAMILIES:
            item.add_marker(skip)


def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "family_stack: a family served by a real PD stack")
