"""Twenty-two SIGKILLs in a row under streaming load, on a PD stack with two workers of each
role and two gateways: each prefill and decode worker four times, the scheduler four times and
the second gateway twice, each at a seeded random moment of a fresh load. A worker's death costs
no request: every stream goes on, on the other worker of that role, to exactly its undisturbed
text, with no error event. A scheduler's death ends the streams in flight with a clear error
event (it holds their state) and the restarted one serves. A gateway's death costs only the
connections on it: the streams on the other gateway are untouched. After each kill the stack heals (the victim restarted, every block free, nothing stuck)
before the next. The figures (kills, requests lost, the first token after each worker kill)
are printed and written to `kill-series.json` beside the stack's logs, or to
KVRELAY_CHAOS_REPORT."""
from __future__ import annotations

import copy
import json
import os
import random
import signal
import statistics
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.chaos.load import GreedyLoad, wait_healed
from tests.e2e.stack import start_stack, stop_and_check

SEED = int(os.environ.get("KVRELAY_CHAOS_SEED", "0"))
WORKERS = ("decode-0", "prefill-0", "decode-1", "prefill-1")
VICTIMS = [*WORKERS * 4, *["scheduler"] * 4, *["gateway-1"] * 2]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = start_stack("pd", tmp_path_factory.mktemp("kill-series"),
                          "--prefill-workers", "2", "--decode-workers", "2",
                          "--gateways", "2", "--max-restarts", "100",
                          num_internal_ports=2 * (2 + 4), num_gateways=2)
    yield running
    stop_and_check(running)


def test_kills_cost_no_request_to_a_worker_death(stack):
    load = GreedyLoad(stack.state["rest_urls"][0] + "/v1", num_prompts=6, max_tokens=64)
    on_victim_gateway = copy.copy(load)
    on_victim_gateway.base_url = stack.state["rest_urls"][1] + "/v1"
    rng = random.Random(f"{SEED}-series")
    order = rng.sample(VICTIMS, len(VICTIMS))
    first_tokens: dict[str, list[float]] = {"decode": [], "prefill": []}
    lost_to_scheduler = cut_with_gateway = 0
    for victim in order:
        run = load.start()
        doomed = on_victim_gateway.start() if victim.startswith("gateway") else None
        time.sleep(rng.uniform(0.3, 2.0))
        killed_at = time.monotonic()
        os.kill(stack.service(victim)["pid"], signal.SIGKILL)
        if victim == "scheduler":
            lost_to_scheduler += run.check_exact_or_clear_error(timeout_s=120)
        elif doomed is not None:
            run.check_exact(timeout_s=240)  # the other gateway's streams are untouched
            cut_with_gateway += doomed.check_exact_or_cut(timeout_s=120)
        else:
            run.check_exact(timeout_s=240)  # nothing lost, nothing repeated or skipped
            first_tokens[victim.split("-")[0]].extend(run.gaps_after(killed_at))
        wait_healed(stack, victim)
    load.start().check_exact(timeout_s=240)  # and it serves as before
    report = _report(order, first_tokens, lost_to_scheduler, cut_with_gateway, load)
    print(json.dumps(report, indent=1))
    path = os.environ.get("KVRELAY_CHAOS_REPORT") or stack.log_dir / "kill-series.json"
    Path(path).write_text(json.dumps(report, indent=1))
    restarts = {name: stack.service(name)["restarts"] for name in set(VICTIMS)}
    assert restarts == {name: VICTIMS.count(name) for name in restarts}, restarts


def _report(order: list[str], first_tokens: dict[str, list[float]], lost_to_scheduler: int,
            cut_with_gateway: int, load: GreedyLoad) -> dict:
    def percentiles(values: list[float]) -> dict:
        if len(values) < 2:
            return {"n": len(values)}
        cuts = statistics.quantiles(values, n=100, method="inclusive")
        return {"n": len(values), "p50_s": round(cuts[49], 3), "p99_s": round(cuts[98], 3),
                "max_s": round(max(values), 3)}

    kills = Counter(victim.split("-")[0] for victim in order)
    return {"kills": len(order), "by_role": dict(kills),
            "streams_per_kill": len(load.bodies),
            "requests_lost_to_worker_deaths": 0,  # check_exact above: every one completed
            "requests_ended_by_scheduler_deaths": lost_to_scheduler,
            "connections_cut_with_their_gateway": cut_with_gateway,
            "first_token_after_kill": {role: percentiles(values)
                                       for role, values in first_tokens.items()}}
