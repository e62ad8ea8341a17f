"""A soak: mixed traffic (workload.py) from a few clients at once on a real PD stack for
KVRELAY_SOAK_MINUTES (30 by default), while every service's private resident memory and open
file descriptors are sampled. It asserts no error of any kind, no restart, memory and descriptors
flat once warm (the median of the last quarter against that of the second), and, at the end,
every block free and every gauge at zero. The figures go to `soak.json` beside the stack's
logs, or to KVRELAY_SOAK_REPORT. `make soak` runs it."""
from __future__ import annotations

import copy
import json
import os
import random
import statistics
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.chaos.load import wait_healed
from tests.e2e.stack import metric_values, start_stack, stop_and_check
from tests.soak.workload import Workload

MINUTES = float(os.environ.get("KVRELAY_SOAK_MINUTES", "30"))
SEED = int(os.environ.get("KVRELAY_SOAK_SEED", "0"))
NUM_CLIENTS = 6
SAMPLE_EVERY_S = 20.0
RSS_GROWTH_BUDGET_MB = 48.0  # allocator noise; a leak per request would be far past it
FD_GROWTH_BUDGET = 8


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = start_stack("pd", tmp_path_factory.mktemp("soak"))
    yield running
    stop_and_check(running)


def _usage(pid: int) -> tuple[float, float, int]:
    """(private resident MB, shared-memory resident MB, open descriptors) of a process. Only
    the private part can leak: the shared part is a decode worker's KV cache file, mapped by
    the prefill worker too for the shm transport, which becomes resident block by block as
    pushes first touch them (bounded by the cache's size)."""
    with open(f"/proc/{pid}/status") as status:
        fields = {line.split(":")[0]: int(line.split()[1]) for line in status
                  if line.startswith(("RssAnon:", "RssShmem:"))}
    return (fields["RssAnon"] / 1024, fields["RssShmem"] / 1024,
            len(os.listdir(f"/proc/{pid}/fd")))


class Sampler(threading.Thread):
    """Every SAMPLE_EVERY_S: each service's (seconds since start, private MB, shared MB,
    descriptors)."""

    def __init__(self, stack, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.pids = {name: service["pid"] for name, service in stack.state["services"].items()}
        self.stop, self.started = stop, time.monotonic()
        self.samples: dict[str, list[tuple[float, float, float, int]]] = {
            name: [] for name in self.pids}

    def run(self) -> None:
        while not self.stop.wait(SAMPLE_EVERY_S):
            for name, pid in self.pids.items():
                self.samples[name].append((time.monotonic() - self.started, *_usage(pid)))


def _client(workload: Workload, index: int, stop: threading.Event, done: Counter,
            errors: Counter) -> None:
    rng = random.Random(f"{SEED}-{index}")
    with httpx.Client(base_url=workload.base_url, timeout=180, trust_env=False) as http:
        mine = copy.copy(workload)
        mine.http = http
        kinds = mine.kinds()
        while not stop.is_set():
            kind = rng.choice(kinds)
            try:
                problem = kind(rng)
            except httpx.HTTPError as exc:
                problem = f"{kind.__name__}: {type(exc).__name__}: {exc}"
            done[kind.__name__] += 1
            if problem:
                errors[problem] += 1


def _flatness(samples: list[tuple[float, float, float, int]]) -> dict:
    """Medians of the second and the last quarter of the samples, and the growth between."""
    quarter = max(1, len(samples) // 4)
    second, last = samples[quarter:2 * quarter], samples[-quarter:]
    rss = (statistics.median(s[1] for s in second), statistics.median(s[1] for s in last))
    fds = (statistics.median(s[3] for s in second), statistics.median(s[3] for s in last))
    return {"private_mb": [round(v, 1) for v in rss],
            "private_growth_mb": round(rss[1] - rss[0], 1),
            "private_max_mb": round(max(s[1] for s in samples), 1),
            "shared_mb_first_last": [round(samples[0][2], 1), round(samples[-1][2], 1)],
            "fds": list(fds), "fd_growth": fds[1] - fds[0]}


def test_soak_of_mixed_traffic(stack):
    model = httpx.get(f"{stack.base_url}/models", trust_env=False).json()["data"][0]["id"]
    with httpx.Client(timeout=180, trust_env=False) as http:
        workload = Workload(http, stack.base_url, model)
    stop, done, errors = threading.Event(), Counter(), Counter()
    sampler = Sampler(stack, stop)
    clients = [threading.Thread(target=_client, args=(workload, i, stop, done, errors),
                                daemon=True) for i in range(NUM_CLIENTS)]
    sampler.start()
    for client in clients:
        client.start()
    time.sleep(MINUTES * 60)
    stop.set()
    for client in clients:
        client.join(300)
    assert not any(client.is_alive() for client in clients), "a client hung"
    wait_healed(stack, None)
    usage = metric_values(stack.service("scheduler")["metrics_url"],
                          "kvrelay:kv_cache_usage_perc")
    report = {"minutes": MINUTES, "clients": NUM_CLIENTS, "requests": sum(done.values()),
              "by_kind": dict(done), "errors": dict(errors),
              "restarts": {name: service["restarts"]
                           for name, service in stack.state["services"].items()},
              "kv_cache_usage_at_idle": usage,
              "services": {name: _flatness(samples)
                           for name, samples in sampler.samples.items()}}
    print(json.dumps(report, indent=1))
    path = os.environ.get("KVRELAY_SOAK_REPORT") or stack.log_dir / "soak.json"
    Path(path).write_text(json.dumps(report, indent=1))
    assert not errors, errors
    assert not any(report["restarts"].values()), report["restarts"]
    assert all(value == 0 for value in usage.values()), usage
    for name, flat in report["services"].items():
        assert flat["private_growth_mb"] < RSS_GROWTH_BUDGET_MB, (name, flat)
        assert flat["fd_growth"] <= FD_GROWTH_BUDGET, (name, flat)
