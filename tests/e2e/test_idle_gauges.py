"""At idle every running, waiting, transferring and KV-usage gauge of the scheduler reads zero
(issue: the KV usage of a prefill worker kept its last step's value once its pages had gone);
the KV capacity gauge reads each worker's blocks times their size."""
from __future__ import annotations

import time

from kvrelay.engine.config import EngineConfig
from tests.e2e.stack import NUM_KV_BLOCKS, metric_values

GAUGES = ("kvrelay:kv_cache_usage_perc", "kvrelay:num_requests_running",
          "kvrelay:num_requests_waiting", "kvrelay:num_requests_transferring")


def test_gauges_read_zero_once_requests_are_done(pd_stack, pd_client, model_id):
    for index in range(4):
        pd_client.chat.completions.create(
            model=model_id, max_tokens=8, temperature=0,
            messages=[{"role": "user", "content": f"Count to {index + 3}."}])
    url = pd_stack.service("scheduler")["metrics_url"]
    deadline = time.monotonic() + 5  # the scheduler refreshes them every lease / 4 (0.75 s)
    while True:
        values = {name: metric_values(url, name) for name in GAUGES}
        if all(value == 0 for series in values.values() for value in series.values()):
            break
        assert time.monotonic() < deadline, values
        time.sleep(0.25)
    assert values["kvrelay:kv_cache_usage_perc"], "no KV usage series at all"


def test_kv_capacity_is_each_workers_blocks_times_their_size(pd_stack):
    url = pd_stack.service("scheduler")["metrics_url"]
    deadline = time.monotonic() + 5  # set by the same refresh as the gauges above
    while not (capacity := metric_values(url, "kvrelay:kv_cache_capacity_tokens")):
        assert time.monotonic() < deadline, "no KV capacity series"
        time.sleep(0.25)
    assert len(capacity) == 2, capacity  # the prefill and the decode worker
    assert set(capacity.values()) == {NUM_KV_BLOCKS * EngineConfig().block_size}, capacity
