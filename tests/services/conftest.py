"""Real service processes for the service tests: free ports, start, wait for health, stop."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 90.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def grpc_health(address: str, timeout: float = 1.0) -> str:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=timeout)
        except grpc.RpcError:
            return "UNREACHABLE"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


class ServiceProcess:
    """One `kvrelay <command>` child process, its log kept in a file for failure messages."""

    def __init__(self, command: str, args: list[str], log_path: Path) -> None:
        self.log_path = log_path
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        self.log_file = log_path.open("wb")
        self.process = subprocess.Popen([sys.executable, "-m", "kvrelay.cli", command, *args],
                                        cwd=REPO, env=env, stdout=self.log_file,
                                        stderr=subprocess.STDOUT)

    def wait_for(self, ready, what: str, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            if self.process.poll() is not None:
                raise RuntimeError(f"{what} exited with {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} not ready after {timeout}s:\n{self.log()}")
            time.sleep(0.2)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        stop_all([self])


def stop_all(services: list[ServiceProcess], timeout: float = 15) -> None:
    """SIGTERM every service at once (each drains on its own), then wait; kill stragglers."""
    for service in services:
        if service.process.poll() is None:
            service.process.terminate()
    for service in services:
        try:
            service.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            service.process.kill()
            service.process.wait()
        service.log_file.close()


@dataclass
class TokenizerService:
    address: str
    metrics_url: str

    def metric(self, name: str) -> float:
        """A sample's value from the service's Prometheus page (0 when absent)."""
        with urllib.request.urlopen(self.metrics_url, timeout=5) as response:
            for line in response.read().decode().splitlines():
                if line.startswith(name + " "):
                    return float(line.split()[1])
        return 0.0


@pytest.fixture(scope="session")
def tokenizer_service(tmp_path_factory) -> TokenizerService:
    """A real tokenizer service on the default model."""
    port, metrics_port = free_port(), free_port()
    address = f"127.0.0.1:{port}"
    service = ServiceProcess("tokenizer", ["--host", "127.0.0.1", "--port", str(port),
                                           "--metrics-port", str(metrics_port),
                                           "--log-level", "warning"],
                             tmp_path_factory.mktemp("tokenizer") / "tokenizer.log")
    try:
        service.wait_for(lambda: grpc_health(address) == "SERVING", "tokenizer service")
        yield TokenizerService(address, f"http://127.0.0.1:{metrics_port}/metrics")
    finally:
        service.stop()


@pytest.fixture(scope="session")
def tokenizer_address(tokenizer_service) -> str:
    return tokenizer_service.address
