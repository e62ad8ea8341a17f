"""The compose suite runs only when asked (`make compose-test`, or KVRELAY_COMPOSE=1): it builds
the image and runs the whole stack in Docker, which takes many minutes and a Docker engine."""
from __future__ import annotations

import pytest

from tests.opt_in import skip_unless_enabled


def pytest_collection_modifyitems(config, items) -> None:
    skip_unless_enabled(items, "KVRELAY_COMPOSE", "tests/compose/", "compose-test")


_LINES: list[str] = []


@pytest.fixture(scope="session")
def report(pytestconfig):
    """report(line): shown as the suite runs and again in its summary (past pytest's capture):
    the image's size, the build's time, the time from `up` to the first token..."""
    terminal = pytestconfig.pluginmanager.get_plugin("terminalreporter")

    def write(line: str) -> None:
        _LINES.append(line)
        if terminal is not None:
            terminal.write_line(f"\n[compose] {line}")
    return write


def pytest_terminal_summary(terminalreporter) -> None:
    if _LINES:
        terminalreporter.section("compose")
        for line in _LINES:
            terminalreporter.write_line(line)
