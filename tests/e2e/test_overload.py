"""Overload through a real stack: with a small limit on waiting requests, a burst gets 503s
with Retry-After for what does not fit, the admitted requests complete, every block is free
afterwards, and the stack serves the next request."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.stack import start_stack, stop_and_check
from tests.e2e.test_disconnect import wait_until_all_free

LIMIT = 2
BURST = 24


@pytest.fixture(scope="module")
def limited_stack(tmp_path_factory):
    stack = start_stack("colocated", tmp_path_factory.mktemp("overload-stack"),
                        "--max-queued-requests", str(LIMIT))
    yield stack
    stop_and_check(stack)


def test_a_burst_past_the_limit_gets_503_with_retry_after(limited_stack):
    url = f"{limited_stack.base_url}/chat/completions"
    body = {"model": _model(limited_stack), "max_tokens": 16, "temperature": 0,
            "messages": [{"role": "user", "content": "Count to twenty."}]}

    def send(_):
        with httpx.Client(timeout=120, trust_env=False) as client:
            return client.post(url, json=body)

    with ThreadPoolExecutor(BURST) as pool:
        responses = list(pool.map(send, range(BURST)))
    statuses = sorted(r.status_code for r in responses)
    assert set(statuses) <= {200, 503}, statuses
    refused = [r for r in responses if r.status_code == 503]
    assert refused and len(refused) < BURST
    for response in refused:
        assert response.headers["Retry-After"] == "1"
        error = response.json()["error"]
        assert error["type"] == "service_unavailable" and "overloaded" in error["message"]
    for response in responses:
        if response.status_code == 200:
            assert response.json()["choices"][0]["message"]["content"]
    wait_until_all_free(limited_stack)
    assert send(0).status_code == 200


def _model(stack) -> str:
    with httpx.Client(timeout=30, trust_env=False) as client:
        return client.get(f"{stack.base_url}/models").json()["data"][0]["id"]
