"""The container health probe against a real gRPC health server."""
from __future__ import annotations

import socket
import subprocess
import sys
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvrelay.common import healthcheck


@pytest.fixture
def health_server():
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(None)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serving_and_not_serving(health_server):
    servicer, address = health_server
    servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    assert healthcheck.main([address]) == 1
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck.main([address]) == 0


def test_named_service(health_server):
    servicer, address = health_server
    servicer.set("kvrelay.v1.Worker", health_pb2.HealthCheckResponse.SERVING)
    assert healthcheck.main([address, "--service", "kvrelay.v1.Worker"]) == 0
    assert healthcheck.main([address, "--service", "kvrelay.v1.Unknown"]) == 1  # NOT_FOUND


def test_nothing_listening_fails_fast():
    assert healthcheck.main([f"127.0.0.1:{_free_port()}", "--timeout", "1"]) == 1


def test_runs_as_module(health_server):
    # The exact command the compose healthchecks run.
    servicer, address = health_server
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    done = subprocess.run([sys.executable, "-m", "kvrelay.common.healthcheck", address],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
