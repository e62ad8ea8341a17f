"""Real faults on a real PD stack under load: SIGKILL of the decode worker, of the prefill
worker and of the tokenizer at random moments, SIGSTOP of the decode worker past its lease, and
a thousand client disconnects. After each: every greedy request that was running ended with
exactly the text of an undisturbed run and no error event, every KV block is free on every
worker, and the stack serves the next request. Bounded in time and request count; `make chaos`
runs it."""
from __future__ import annotations

import os
import random
import signal
import time

import pytest

from tests.chaos.load import GreedyLoad, abort_storm, wait_healed
from tests.e2e.stack import start_stack, stop_and_check

SEED = int(os.environ.get("KVRELAY_CHAOS_SEED", "0"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    running = start_stack("pd", tmp_path_factory.mktemp("chaos-stack"))  # leases: 3 s
    yield running
    stop_and_check(running)


@pytest.fixture(scope="module")
def load(stack):
    return GreedyLoad(stack.base_url, num_prompts=8, max_tokens=64)


@pytest.mark.parametrize("victim", ["decode-0", "prefill-0"])
def test_sigkill_at_a_random_moment_costs_no_request(stack, load, victim):
    rng = random.Random(f"{SEED}-{victim}")
    run = load.start()
    time.sleep(rng.uniform(0.2, 2.0))
    os.kill(stack.service(victim)["pid"], signal.SIGKILL)
    run.check_exact(timeout_s=240)
    wait_healed(stack, victim)


def test_a_killed_tokenizer_costs_no_request(stack, load):
    """The tokenizer holds only detokenizer states: `kvrelay up` restarts it, and the gateway
    gives the new one each stream's state again, so every stream goes on to its exact text."""
    run = load.start()
    time.sleep(random.Random(f"{SEED}-tokenizer").uniform(1.0, 2.5))  # after every Encode
    os.kill(stack.service("tokenizer")["pid"], signal.SIGKILL)
    run.check_exact(timeout_s=240)
    wait_healed(stack, "tokenizer")


def test_a_stopped_decode_worker_past_its_lease_costs_no_request(stack, load):
    pid = stack.service("decode-0")["pid"]
    run = load.start()
    time.sleep(1.0)
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(8.0)  # past the 3 s lease: declared dead, its samples recovered elsewhere
    finally:
        os.kill(pid, signal.SIGCONT)  # it wakes to a scheduler that forgot it, and re-registers
    run.check_exact(timeout_s=240)
    wait_healed(stack, None)


def test_a_killed_scheduler_ends_its_streams_clearly_and_comes_back(stack, load):
    """The scheduler holds the requests' state: those in flight end with an error event; the
    restarted scheduler gets its workers back (they register again) and serves."""
    run = load.start()
    time.sleep(random.Random(SEED).uniform(0.5, 1.5))
    os.kill(stack.service("scheduler")["pid"], signal.SIGKILL)
    run.check_exact_or_clear_error(timeout_s=120)
    wait_healed(stack, "scheduler")
    load.start().check_exact(timeout_s=240)


def test_a_thousand_disconnects_leak_nothing(stack, load):
    abort_storm(stack.base_url, load.model, num_requests=1000, concurrency=32,
                rng=random.Random(SEED))
    wait_healed(stack, None)
    load.start().check_exact(timeout_s=240)  # and it serves as before
