"""The chaos suite runs only when asked (`make chaos`, or KVRELAY_CHAOS=1): real faults on a
real stack take minutes, beyond `make test`'s budget."""
from __future__ import annotations

from tests.opt_in import skip_unless_enabled


def pytest_collection_modifyitems(config, items) -> None:
    skip_unless_enabled(items, "KVRELAY_CHAOS", "tests/chaos/", "chaos")
