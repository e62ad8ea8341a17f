"""A gRPC health probe for containers: `python -m services.common.healthcheck HOST:PORT`.

Exits 0 when the server answers SERVING for the service (default "": the whole server) and 1
otherwise (NOT_SERVING while a model loads or the service drains, refused, timed out). Docker
compose has no native gRPC probe and the image ships no grpc_health_probe binary, so this is what
its healthchecks run. It imports only grpc: a probe every few seconds must stay cheap.
"""
from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def check(address: str, service: str = "", timeout_s: float = 3.0) -> bool:
    """True when `address` reports SERVING for `service` within `timeout_s`."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.common.healthcheck",
                                     description="exit 0 if a gRPC server reports SERVING")
    parser.add_argument("address", help="host:port of the gRPC server")
    parser.add_argument("--service", default="", help="health service name ('' = the server)")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds")
    args = parser.parse_args(argv)
    healthy = check(args.address, args.service, args.timeout)
    if not healthy:
        print(f"{args.address}: not serving", file=sys.stderr)
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
