"""The fuzz suite runs only when asked (`make fuzz`, or KVRELAY_FUZZ=1): thousands of generated
requests on a real stack take minutes, beyond `make test`'s budget.

One colocated stack on loopback serves the whole suite, with small limits so that whatever the
fuzzers make generates little: a 64-token context (KVRELAY_MAX_MODEL_LEN reaches the worker),
at most 2 choices and 4 prompts per request (the gateway's --max-n and --max-prompts). After
each fuzzer: the stack still serves a normal request, no service crashed or restarted, and
every KV block is free."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from tests.opt_in import skip_unless_enabled

from tests.e2e.stack import STARTUP_TIMEOUT_S, RunningStack, free_port_block, stop_and_check

# What the stack's services read from their KVRELAY_* variables (`kvrelay up` passes on those
# that are not its own flags).
STACK_ENV = {"KVRELAY_MAX_MODEL_LEN": "64", "KVRELAY_MAX_N": "2", "KVRELAY_MAX_PROMPTS": "4"}
NUM_KV_BLOCKS = 256
REQUEST_TIMEOUT_S = 60  # a request without an answer by then is a hang
# Every fuzzer's tally: {fuzzer: Counter(status)} and its seconds, printed at the end.
TALLIES: dict[str, Counter] = {}
SECONDS: dict[str, float] = {}


def pytest_ignore_collect(collection_path, config) -> bool | None:
    """Without KVRELAY_FUZZ=1 the fuzzers are not even imported: schemathesis is installed by
    `make fuzz` only."""
    if os.environ.get("KVRELAY_FUZZ") != "1" and collection_path.name.startswith("test_"):
        return True
    return None


def pytest_collection_modifyitems(config, items) -> None:
    skip_unless_enabled(items, "KVRELAY_FUZZ", "tests/fuzz/", "fuzz")


def pytest_terminal_summary(terminalreporter) -> None:
    for name, tally in TALLIES.items():
        statuses = ", ".join(f"{status}: {count}" for status, count in sorted(tally.items()))
        terminalreporter.write_line(f"fuzz {name}: {sum(tally.values())} requests in "
                                    f"{SECONDS.get(name, 0):.0f} s ({statuses})")


@pytest.fixture(scope="package")
def fuzz_stack(tmp_path_factory) -> RunningStack:
    stack = start_fuzz_stack(tmp_path_factory.mktemp("fuzz-stack"))
    try:
        models = httpx.get(f"{stack.base_url}/models", timeout=10, trust_env=False).json()
        assert models["data"][0]["max_model_len"] == int(STACK_ENV["KVRELAY_MAX_MODEL_LEN"])
        yield stack
    finally:
        stop_and_check(stack)


def start_fuzz_stack(log_dir: Path) -> RunningStack:
    # tokenizer, scheduler, one --role both worker: a port and a metrics port each; and the
    # gateway's metrics port
    num_internal = 7
    base = free_port_block(num_internal + 2)
    command = [sys.executable, "-m", "kvrelay.cli", "up", "--topology", "colocated",
               "--base-port", str(base), "--port", str(base + num_internal),
               "--grpc-port", str(base + num_internal + 1), "--dtype", "float32",
               "--num-kv-blocks", str(NUM_KV_BLOCKS), "--log-dir", str(log_dir),
               "--startup-timeout", str(STARTUP_TIMEOUT_S)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")
           or k == "KVRELAY_CACHE_DIR"}
    env.update(STACK_ENV, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    with open(log_dir / "up.log", "wb") as up_log:
        process = subprocess.Popen(command, env=env, stdout=up_log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
    stack = RunningStack(process, log_dir, "colocated")
    deadline = time.monotonic() + STARTUP_TIMEOUT_S + 10
    while not ((log_dir / "stack.json").exists() and stack.state["status"] == "ready"):
        if process.poll() is not None or time.monotonic() > deadline:
            stack.stop()
            raise RuntimeError(f"the fuzz stack did not start:\n{stack.up_log()}")
        time.sleep(0.25)
    return stack


def assert_stack_fine(stack: RunningStack, pids_before: dict[str, int]) -> None:
    """No service crashed (same pids, no restarts), every KV block is free once nothing runs,
    and a normal request is served."""
    services = stack.state["services"]
    assert {name: s["pid"] for name, s in services.items()} == pids_before
    assert all(s["restarts"] == 0 for s in services.values()), services
    deadline = time.monotonic() + 30
    while True:
        stats = stack.scheduler_stats()
        busy = [(w.worker_id, w.num_free_blocks, w.num_blocks) for w in stats.workers
                if w.num_free_blocks != w.num_blocks]
        if not (busy or stats.num_running or stats.num_waiting):
            break
        assert time.monotonic() < deadline, (busy, stats.num_running, stats.num_waiting)
        time.sleep(0.2)
    reply = httpx.post(f"{stack.base_url}/chat/completions", timeout=REQUEST_TIMEOUT_S,
                       trust_env=False, json={"messages": [{"role": "user", "content": "Hi"}],
                                              "max_tokens": 8, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["message"]["content"]


def service_pids(stack: RunningStack) -> dict[str, int]:
    return {name: s["pid"] for name, s in stack.state["services"].items()}
