"""`kvrelay up` as a supervisor: it fails fast and clearly, and no child outlives it, even when
it is SIGKILLed itself."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

from tests.e2e.stack import process_running, free_port_block


def up_command(log_dir, *extra: str) -> list[str]:
    base = free_port_block(11)  # 4 services' gRPC and metrics ports, the gateway's metrics
    return [sys.executable, "-m", "kvrelay.cli", "up", "--base-port", str(base),
            "--port", str(base + 9), "--grpc-port", str(base + 10), "--log-dir", str(log_dir),
            *extra]


def child_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_")
           or k == "KVRELAY_CACHE_DIR"}
    return {**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def test_a_busy_port_is_refused_before_anything_starts(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        command = up_command(tmp_path) + ["--port", str(port)]
        result = subprocess.run(command, env=child_env(), capture_output=True, text=True,
                                timeout=60)
    assert result.returncode == 2
    assert f"already in use on 127.0.0.1: {port}" in result.stdout
    assert not (tmp_path / "stack.json").exists()


def test_a_child_failing_at_start_up_stops_the_stack_with_its_log(tmp_path):
    command = up_command(tmp_path, "--model", str(tmp_path / "no-such-model"))
    result = subprocess.run(command, env=child_env(), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 1, result.stdout
    assert "tokenizer exited with code" in result.stdout, result.stdout
    assert "no-such-model" in result.stdout, result.stdout  # the tail of the tokenizer's log
    state = json.loads((tmp_path / "stack.json").read_text())
    assert state["status"] == "failed"
    assert not any(s["pid"] and process_running(s["pid"]) for s in state["services"].values())


def test_children_die_with_a_sigkilled_up(tmp_path):
    up = subprocess.Popen(up_command(tmp_path), env=child_env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
    state_path = tmp_path / "stack.json"
    deadline = time.monotonic() + 60
    pids: list[int] = []
    while len(pids) < 2:  # tokenizer and scheduler start at once
        assert time.monotonic() < deadline and up.poll() is None
        if state_path.exists():
            state = json.loads(state_path.read_text())
            pids = [s["pid"] for s in state["services"].values() if s["pid"]]
        time.sleep(0.1)
    up.send_signal(signal.SIGKILL)
    up.wait()
    deadline = time.monotonic() + 5
    while any(process_running(pid) for pid in pids):
        assert time.monotonic() < deadline, f"children outlived kvrelay up: {pids}"
        time.sleep(0.05)
