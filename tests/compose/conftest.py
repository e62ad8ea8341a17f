"""The compose suite runs only when asked (`make compose-test`, or KVRELAY_COMPOSE=1): it builds
the image and runs the whole stack in Docker, which takes many minutes and a Docker engine."""
from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config, items) -> None:
    if os.environ.get("KVRELAY_COMPOSE") == "1":
        return
    skip = pytest.mark.skip(reason="the compose suite runs with `make compose-test` "
                                   "(KVRELAY_COMPOSE=1)")
    for item in items:
        if "tests/compose/" in str(item.fspath).replace(os.sep, "/"):
            item.add_marker(skip)


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
