"""The soak runs only when asked (`make soak`, or KVRELAY_SOAK=1): 30 minutes of mixed traffic
on a real stack, far beyond `make test`'s budget."""
from __future__ import annotations

from tests.opt_in import skip_unless_enabled


def pytest_collection_modifyitems(config, items) -> None:
    skip_unless_enabled(items, "KVRELAY_SOAK", "tests/soak/", "soak")
