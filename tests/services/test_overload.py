"""Overload is bounded: past the scheduler's limits on waiting requests and on their prompt
tokens a request is refused (RESOURCE_EXHAUSTED -> the gateway's 503 with Retry-After), and a
refused request leaves nothing behind; below them nothing is refused."""
from __future__ import annotations

import grpc
import pytest

from kvrelay.gateway.errors import from_rpc_error
from kvrelay.scheduler.cluster import Overloaded
from tests.services.cluster_driver import LENGTH, pd_driver, colocated_driver, prompt

TOPOLOGIES = {"pd": pd_driver, "colocated": colocated_driver}


@pytest.mark.parametrize("topology", TOPOLOGIES)
def test_waiting_requests_are_bounded_and_the_admitted_ones_finish(topology):
    driver = TOPOLOGIES[topology](scheduler_config={"max_queued_requests": 3})
    for index in range(3):
        driver.submit(f"r{index}", prompt(8, first=10 * index), max_tokens=2)
    with pytest.raises(Overloaded, match="3 requests are waiting"):
        driver.submit("refused", prompt(8, first=50), max_tokens=2)
    with pytest.raises(Overloaded):  # n counts: two samples would not fit either
        driver.submit("pair", prompt(8, first=60), max_tokens=2, n=2)
    assert "refused" not in driver.cluster.requests and "pair/0" not in driver.cluster.samples
    driver.run()
    for index in range(3):
        assert driver.final(f"r{index}").finish_reason == LENGTH
    driver.check_accounting()
    driver.assert_quiescent()
    driver.submit("later", prompt(8, first=70), max_tokens=2)  # room again
    driver.run()
    assert driver.final("later").finish_reason == LENGTH


def test_queued_prompt_tokens_are_bounded_but_one_long_prompt_alone_runs():
    driver = colocated_driver(64, scheduler_config={"max_queued_requests": 0,
                                                    "max_queued_prompt_tokens": 40})
    driver.submit("small", prompt(10), max_tokens=1)
    driver.submit("medium", prompt(25, first=100), max_tokens=1)
    with pytest.raises(Overloaded, match="35 prompt tokens are waiting"):
        driver.submit("big", prompt(100, first=200), max_tokens=1)
    driver.run()
    driver.submit("big", prompt(100, first=200), max_tokens=1)  # over the limit, alone: runs
    driver.run()
    assert driver.final("big").finish_reason == LENGTH
    driver.check_accounting()
    driver.assert_quiescent()


def test_no_limit_when_both_are_zero():
    driver = colocated_driver(scheduler_config={"max_queued_requests": 0,
                                                "max_queued_prompt_tokens": 0})
    for index in range(50):
        driver.submit(f"r{index}", prompt(4, first=index * 4), max_tokens=1)
    assert driver.cluster.queued_work()[0] == 50


class _RpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


def test_the_gateway_answers_an_overloaded_scheduler_with_503_and_retry_after():
    error = from_rpc_error(_RpcError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                     "overloaded: 3 requests are waiting"), "scheduler")
    assert (error.http_status, error.retry_after_s) == (503, 1)
    assert error.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "overloaded" in error.body()["error"]["message"]
    unavailable = from_rpc_error(_RpcError(grpc.StatusCode.UNAVAILABLE, "down"), "scheduler")
    assert (unavailable.http_status, unavailable.retry_after_s) == (503, None)
