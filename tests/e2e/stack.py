"""A real `kvrelay up` for the end-to-end tests: started on free ports, read through its state
file, stopped with SIGTERM like an operator would."""
from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx

from kvrelay.api.kvrelay.v1 import scheduler_pb2, scheduler_pb2_grpc
from kvrelay.common.tls import target_options
from kvrelay.stack.health import admin_credentials
from kvrelay.stack.ports import busy_ports

STARTUP_TIMEOUT_S = 300
STOP_TIMEOUT_S = 90
# Below Linux's ephemeral range (32768+), so outgoing connections do not take our ports.
PORT_RANGE = (10000, 32000)
# Small enough to keep three stacks in memory, big enough for 32 concurrent requests.
NUM_KV_BLOCKS = 1024


@dataclass
class RunningStack:
    process: subprocess.Popen
    log_dir: Path
    topology: str

    @property
    def state(self) -> dict:
        return json.loads((self.log_dir / "stack.json").read_text())

    @property
    def rest_url(self) -> str:
        return self.state["rest_url"]

    @property
    def base_url(self) -> str:
        return self.state["openai_base_url"]

    @property
    def grpc_address(self) -> str:
        return self.state["grpc_address"]

    def service(self, name: str) -> dict:
        return self.state["services"][name]

    def workers(self) -> dict[str, dict]:
        return {name: s for name, s in self.state["services"].items() if s["kind"] == "worker"}

    def scheduler_stats(self, scheduler: str = "scheduler") -> scheduler_pb2.StatsResponse:
        with self.internal_channel(scheduler) as channel:
            stub = scheduler_pb2_grpc.SchedulerStub(channel)
            return stub.Stats(scheduler_pb2.StatsRequest(), timeout=5)

    def internal_channel(self, name: str) -> grpc.Channel:
        """A channel to an internal service: with the stack's admin certificate under TLS."""
        service, tls_dir = self.service(name), self.state.get("tls_dir")
        if not tls_dir:
            return grpc.insecure_channel(service["address"])
        return grpc.secure_channel(service["address"], admin_credentials(tls_dir),
                                   options=target_options(service["kind"]))

    def up_log(self, lines: int = 80) -> str:
        text = (self.log_dir / "up.log").read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def stop(self) -> int:
        """SIGTERM `up` and return its exit code."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        return self.process.wait(STOP_TIMEOUT_S)

    def surviving_children(self) -> list[str]:
        return [f"{name} (pid {s['pid']})" for name, s in self.state["services"].items()
                if s["pid"] and process_running(s["pid"])]


def free_port_block(count: int) -> int:
    for _ in range(50):
        base = random.randrange(PORT_RANGE[0], PORT_RANGE[1] - count)
        if not busy_ports("127.0.0.1", list(range(base, base + count))):
            return base
    raise RuntimeError(f"no {count} consecutive free ports in {PORT_RANGE}")


def start_stack(topology: str, log_dir: Path, *extra: str, num_internal_ports: int = 0,
                num_gateways: int = 1, num_kv_blocks: int = NUM_KV_BLOCKS,
                env: dict[str, str] | None = None) -> RunningStack:
    """num_internal_ports: what the topology in `extra` needs (default: one group of one
    tokenizer, one scheduler and the topology's default workers); env: KVRELAY_* variables
    for the services' own flags (the stack's come from `extra`)."""
    log_dir.mkdir(parents=True, exist_ok=True)
    num_workers = 2 if topology == "pd" else 1
    # The internal block: gRPC and metrics of each service, then each gateway's metrics.
    num_internal = (num_internal_ports or 2 * (2 + num_workers)) + num_gateways
    base = free_port_block(num_internal + 2 * num_gateways)
    command = [sys.executable, "-m", "kvrelay.cli", "up", "--topology", topology,
               "--base-port", str(base), "--port", str(base + num_internal),
               "--grpc-port", str(base + num_internal + num_gateways), "--dtype", "float32",
               "--num-kv-blocks", str(num_kv_blocks), "--log-dir", str(log_dir),
               "--startup-timeout", str(STARTUP_TIMEOUT_S), *extra]
    # The stack's flags come from the command line only, never from the test's environment.
    services_env = env or {}
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")
           or k == "KVRELAY_CACHE_DIR"}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", **services_env)
    with open(log_dir / "up.log", "wb") as up_log:
        process = subprocess.Popen(command, env=env, stdout=up_log, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL)
    stack = RunningStack(process, log_dir, topology)
    _wait_ready(stack)
    return stack


def _wait_ready(stack: RunningStack) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S + 10
    state_path = stack.log_dir / "stack.json"
    while time.monotonic() < deadline:
        if stack.process.poll() is not None:
            raise RuntimeError(f"kvrelay up exited with {stack.process.returncode} before it was "
                               f"ready:\n{stack.up_log()}")
        if state_path.exists() and stack.state["status"] == "ready":
            return
        time.sleep(0.25)
    stack.stop()
    raise RuntimeError(f"kvrelay up not ready after {STARTUP_TIMEOUT_S}s:\n{stack.up_log()}")


def stop_and_check(stack: RunningStack, expected_code: int = 0) -> None:
    """The teardown every stack fixture shares: a clean exit and no orphans."""
    code = stack.stop()
    assert code == expected_code, f"kvrelay up exited with {code}:\n{stack.up_log()}"
    assert stack.state["status"] == ("stopped" if expected_code == 0 else "failed")
    assert not stack.surviving_children(), stack.surviving_children()
    assert_clean_logs(stack.log_dir)


def assert_clean_logs(log_dir: Path) -> None:
    """A clean exit prints only the services' own lines: no binding's leak report."""
    for log in log_dir.glob("*.log"):
        assert "nanobind: leaked" not in log.read_text(errors="replace"), log.name


def process_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def metric_values(url: str, name: str) -> dict[str, float]:
    """{label text: value} of one metric on a Prometheus endpoint."""
    text = httpx.get(url, timeout=10, trust_env=False).text
    values = {}
    for match in re.finditer(rf"^{re.escape(name)}(\{{[^}}]*\}})? (\S+)$", text, re.MULTILINE):
        values[match.group(1) or ""] = float(match.group(2))
    return values
