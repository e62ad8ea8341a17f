"""The KV path between the workers, cut, stalled and slowed. The decode worker registers a KV
address (`--kv-advertise-address`) that is a TCP proxy in this test, in front of its own port,
so the prefill worker's pushes over the gRPC transport go through the proxy while the
scheduler's step streams do not. Under load of greedy streams: a slow link only delays the
pushes; a cut fails the pushes in flight, which are prefilled again and pushed once the link is
back; a stalled link makes pushes time out at their deadline (bytes that arrive after it are
refused by the receiver), and they are prefilled again and pushed once it moves. Each stream still ends with exactly its undisturbed text and no error event, and
afterwards every block is free (a failed push's blocks are held only until its deadline)."""
from __future__ import annotations

import os
import random
import time

import pytest

from tests.chaos.load import GreedyLoad, wait_healed
from tests.e2e.stack import metric_values, start_stack, stop_and_check
from tests.services.tcp_proxy import TcpProxy

SEED = int(os.environ.get("KVRELAY_CHAOS_SEED", "0"))
TRANSFER_TIMEOUT_S = 6.0  # the scheduler's deadline for each push, and the sender's timeout


@pytest.fixture(scope="module")
def proxy():
    running = TcpProxy(None)  # pointed at the decode worker once the stack has given it a port
    yield running
    running.close()


@pytest.fixture(scope="module")
def stack(tmp_path_factory, proxy):
    running = start_stack("pd", tmp_path_factory.mktemp("kv-path"), "--kv-transport", "grpc",
                          env={"KVRELAY_KV_ADVERTISE_ADDRESS": proxy.address,
                               "KVRELAY_KV_TRANSFER_TIMEOUT": str(TRANSFER_TIMEOUT_S)})
    proxy.point_at(running.service("decode-0")["address"])
    yield running
    stop_and_check(running)


@pytest.fixture(scope="module")
def load(stack, proxy):
    loaded = GreedyLoad(stack.base_url, num_prompts=8, max_tokens=48)
    assert proxy.num_connections > 0, "the pushes did not take the KV address"
    return loaded


def _counts(stack) -> tuple[float, float]:
    """(failed pushes on the prefill worker, samples recovered by the scheduler) so far."""
    failures = metric_values(stack.service("prefill-0")["metrics_url"],
                             "kvrelay:kv_transfer_failures_total")
    recoveries = metric_values(stack.service("scheduler")["metrics_url"],
                               "kvrelay:request_recoveries_total")
    return sum(failures.values()), sum(recoveries.values())


def test_a_slow_kv_link_only_delays_the_pushes(stack, proxy, load):
    before = _counts(stack)
    proxy.delay_s = 0.01  # per read of at most 64 KiB, each way
    try:
        load.start().check_exact(timeout_s=240)
    finally:
        proxy.delay_s = 0.0
    assert _counts(stack) == before  # nothing failed, nothing was prefilled twice
    wait_healed(stack, None)


def test_a_cut_kv_link_costs_no_request(stack, proxy, load):
    before = _counts(stack)
    rng = random.Random(f"{SEED}-cut")
    run = load.start()
    time.sleep(rng.uniform(0.1, 0.6))  # while the first prompts' pages are on their way
    proxy.cut(refuse=True)
    time.sleep(1.5)  # pushes started now wait for the link (wait_for_ready), within deadline
    proxy.accept()
    run.check_exact(timeout_s=240)
    failures, recoveries = _counts(stack)
    # each failed push cost one re-prefill (and a push relying on its shared blocks, another)
    assert recoveries - before[1] >= failures - before[0]
    wait_healed(stack, None)
    load.start().check_exact(timeout_s=240)  # the link serves as before


def test_a_stalled_kv_link_times_out_and_is_retried(stack, proxy, load):
    before = _counts(stack)
    proxy.hold(uploads=True)  # the decode worker hears nothing of the pushes
    run = load.start()
    time.sleep(TRANSFER_TIMEOUT_S + 1.0)  # past every held push's deadline
    proxy.release()  # the held frames arrive late, the re-prefilled samples' pushes in time
    run.check_exact(timeout_s=240)
    failures, recoveries = _counts(stack)
    assert failures > before[0] and recoveries > before[1]
    wait_healed(stack, None)  # the failed pushes' blocks were held to their deadline, then freed
