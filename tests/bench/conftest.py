from __future__ import annotations

import pytest

from tests.bench.fake_server import FakeBehaviour, FakeServer


@pytest.fixture
def fake_server():
    with FakeServer(FakeBehaviour()) as server:
        yield server
