"""A gRPC health probe for containers: `python -m kvrelay.common.healthcheck HOST:PORT`.

Exits 0 when the server answers SERVING for the service (default "": the whole server) and 1
otherwise (NOT_SERVING while a model loads or the service drains, refused, timed out). Docker
compose has no native gRPC probe and the image ships no grpc_health_probe binary, so this is what
its healthchecks run. It imports only grpc: a probe every few seconds must stay cheap.

With mutual TLS on (KVRELAY_TLS_CA, KVRELAY_TLS_CERT and KVRELAY_TLS_KEY set, as they are for
the service it runs beside), it presents that service's own certificate and expects the server
to hold the same role: a probe runs in the container of the service it checks.
"""
from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvrelay.common.flags import flag_from_env


def check(address: str, service: str = "", timeout_s: float = 3.0) -> bool:
    """True when `address` reports SERVING for `service` within `timeout_s`."""
    with _channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _channel(address: str) -> grpc.Channel:
    paths = [flag_from_env(flag) for flag in ("--tls-ca", "--tls-cert", "--tls-key")]
    if not all(paths):
        return grpc.insecure_channel(address)
    from kvrelay.common.authz import peer_role_of_pem
    from kvrelay.common.tls import TlsFiles, channel_credentials, target_options
    files = TlsFiles(*paths)
    with open(files.cert, "rb") as handle:
        own_role = peer_role_of_pem(handle.read())
    return grpc.secure_channel(address, channel_credentials(files),
                               options=target_options(own_role))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kvrelay.common.healthcheck",
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
