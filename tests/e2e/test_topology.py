"""Many workers and scheduler groups, as processes on this machine: 2 groups of 2 prefill + 2
decode workers behind 2 gateways. Requests spread over every gateway, group and worker (read from
their metrics); a worker started mid-run joins its group and takes work; a worker sent SIGTERM
mid-run drains without a single failed request, and the stack serves on without it."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from tests.e2e.stack import (free_port_block, metric_values, process_running, start_stack,
                             stop_and_check)

GROUPS, PREFILL, DECODE, GATEWAYS = 2, 2, 2, 2
NUM_KV_BLOCKS = 128  # eleven workers' caches in memory at once; plenty for short requests
JOIN_TIMEOUT_S = 180
DRAIN_TIMEOUT_S = 120

pytestmark = pytest.mark.breaks_stack  # SIGTERMs a worker: runs last, on a stack of its own


@pytest.fixture(scope="module")
def grouped_stack(tmp_path_factory):
    num_internal = 2 * (1 + GROUPS + GROUPS * (PREFILL + DECODE))
    stack = start_stack("pd", tmp_path_factory.mktemp("grouped-stack"),
                        "--groups", str(GROUPS), "--gateways", str(GATEWAYS),
                        "--prefill-workers", str(PREFILL), "--decode-workers", str(DECODE),
                        "--threads-per-worker", "1",
                        # The default (shm between same-host workers) serves the other stacks.
                        "--kv-transport", "grpc", num_internal_ports=num_internal,
                        num_gateways=GATEWAYS, num_kv_blocks=NUM_KV_BLOCKS)
    yield stack
    stop_and_check(stack)


def worker_steps(stack, scheduler: str) -> dict[str, float]:
    """{worker id: steps it ran} from that group's scheduler."""
    steps = metric_values(stack.service(scheduler)["metrics_url"], "kvrelay:worker_steps_total")
    return {re.search(r'worker="([^"]+)"', labels).group(1): value
            for labels, value in steps.items()}


def chat(base_url: str, index: int, max_tokens: int) -> str:
    client = openai.OpenAI(base_url=base_url, api_key="x", max_retries=0, timeout=300)
    text, finish_reason = "", None
    stream = client.chat.completions.create(
        model=client.models.list().data[0].id, stream=True, max_tokens=max_tokens, temperature=0,
        extra_body={"ignore_eos": True},
        messages=[{"role": "user", "content": f"Request {index}: name a colour and a city."}])
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish_reason = chunk.choices[0].finish_reason or finish_reason
    return finish_reason


def run_requests(stack, count: int, max_tokens: int, first_index: int = 0) -> list[str]:
    """`count` concurrent streaming chats over every gateway in turn; their finish reasons."""
    urls = [f"{url}/v1" for url in stack.state["rest_urls"]]
    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(chat, urls[i % len(urls)], first_index + i, max_tokens)
                   for i in range(count)]
        return [future.result() for future in futures]


def start_extra_worker(stack, scheduler: str, log_path) -> tuple[subprocess.Popen, str]:
    port = free_port_block(1)
    worker_id = "g0-decode-late"
    command = [sys.executable, "-m", "kvrelay.cli", "worker", "--role", "decode",
               "--worker-id", worker_id, "--host", "127.0.0.1", "--port", str(port),
               "--advertise-address", f"127.0.0.1:{port}", "--metrics-port", "0",
               "--scheduler-address", stack.service(scheduler)["address"],
               "--dtype", "float32", "--num-kv-blocks", str(NUM_KV_BLOCKS), "--num-threads", "1"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")
           or k == "KVRELAY_CACHE_DIR"}
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
    return process, worker_id


def test_requests_spread_over_every_gateway_group_and_worker(grouped_stack):
    finish_reasons = run_requests(grouped_stack, count=32, max_tokens=8)
    assert finish_reasons == ["length"] * 32
    for group in range(GROUPS):
        steps = worker_steps(grouped_stack, f"scheduler-{group}")
        expected = {f"g{group}-{role}-{i}" for role, count in (("prefill", PREFILL),
                                                               ("decode", DECODE))
                    for i in range(count)}
        assert expected <= {worker for worker, value in steps.items() if value > 0}, steps
    for index in range(GATEWAYS):
        served = metric_values(grouped_stack.service(f"gateway-{index}")["metrics_url"],
                               "kvrelay:request_success_total")
        assert sum(served.values()) > 0, f"gateway-{index} served nothing"


def test_a_worker_started_mid_run_joins_its_group_and_takes_work(grouped_stack, tmp_path):
    process, worker_id = start_extra_worker(grouped_stack, "scheduler-0", tmp_path / "late.log")
    try:
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while worker_id not in _registered(grouped_stack, 0):
            assert process.poll() is None, (tmp_path / "late.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the late worker never registered"
            time.sleep(0.5)
        finish_reasons = run_requests(grouped_stack, count=16, max_tokens=8, first_index=100)
        assert finish_reasons == ["length"] * 16
        assert worker_steps(grouped_stack, "scheduler-0").get(worker_id, 0) > 0
    finally:
        process.send_signal(signal.SIGTERM)  # it drains and leaves like any other worker
        assert process.wait(DRAIN_TIMEOUT_S) == 0, (tmp_path / "late.log").read_text()[-3000:]


def test_a_worker_sent_sigterm_mid_run_drains_without_a_failed_request(grouped_stack):
    doomed = [grouped_stack.service(name) for name in ("g1-prefill-0", "g1-decode-0")]
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(run_requests, grouped_stack, 24, 48, 200)
        _wait_until_busy(grouped_stack, "scheduler-1")
        for service in doomed:
            os.kill(service["pid"], signal.SIGTERM)
        assert running.result() == ["length"] * 24
    names = ("g1-prefill-0", "g1-decode-0")
    deadline = time.monotonic() + DRAIN_TIMEOUT_S
    # Exited, and reaped by `kvrelay up`: its state file gets the exit code a moment later.
    while (any(process_running(service["pid"]) for service in doomed)
           or None in [grouped_stack.service(name)["exit_code"] for name in names]):
        assert time.monotonic() < deadline, "a drained worker did not exit"
        time.sleep(0.5)
    assert [grouped_stack.service(name)["exit_code"] for name in names] == [0, 0]
    assert grouped_stack.state["status"] == "ready"
    live = {w.worker_id for w in _stats(grouped_stack, 1).workers}
    assert not live & set(names) and {"g1-prefill-1", "g1-decode-1"} <= live
    assert run_requests(grouped_stack, count=8, max_tokens=4, first_index=300) == ["length"] * 8


def _registered(stack, group: int) -> set[str]:
    """The group's registered worker ids; empty while its scheduler is too slow to answer (the
    late worker loading its model can hold both cores for seconds: the caller's deadline
    decides, not one Stats call's)."""
    import grpc
    try:
        return {w.worker_id for w in _stats(stack, group).workers}
    except grpc.RpcError as error:
        if error.code() is not grpc.StatusCode.DEADLINE_EXCEEDED:
            raise
        return set()


def _stats(stack, group: int):
    return stack.scheduler_stats(f"scheduler-{group}")


def _wait_until_busy(stack, scheduler: str, timeout_s: float = 60) -> None:
    """Until that group's workers are computing the requests (some tokens generated)."""
    url = stack.service(scheduler)["metrics_url"]
    start = sum(metric_values(url, "kvrelay:generation_tokens_total").values())
    deadline = time.monotonic() + timeout_s
    while sum(metric_values(url, "kvrelay:generation_tokens_total").values()) < start + 20:
        assert time.monotonic() < deadline, "the group never got busy"
        time.sleep(0.1)
