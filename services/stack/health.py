"""Is a service ready? Its gRPC health (service "" covers the server), plus the gateway's REST /health."""
from __future__ import annotations

import urllib.error
import urllib.request

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvrelay.common.tls import TlsFiles, channel_credentials, target_options

PROBE_TIMEOUT_S = 1.0
# Loopback health checks must not go through an HTTP proxy from the environment.
_NO_PROXY_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class HealthProbe:
    def __init__(self, address: str, rest_url: str = "", tls_dir: str = "",
                 tls_role: str = "") -> None:
        """`tls_role`: the role of a server that speaks mutual TLS; the probe then presents
        the stack's admin certificate from `tls_dir` (health is open to any role)."""
        self.address = address
        self.rest_url = rest_url
        options = [("grpc.enable_http_proxy", 0)]
        if tls_role:
            self.channel = grpc.secure_channel(address, admin_credentials(tls_dir),
                                               options=options + target_options(tls_role))
        else:
            self.channel = grpc.insecure_channel(address, options=options)
        self.stub = health_pb2_grpc.HealthStub(self.channel)

    def status(self) -> str:
        """SERVING, NOT_SERVING, UNKNOWN, or UNREACHABLE; the gateway also needs REST /health 200."""
        try:
            reply = self.stub.Check(health_pb2.HealthCheckRequest(service=""),
                                    timeout=PROBE_TIMEOUT_S)
        except grpc.RpcError:
            return "UNREACHABLE"
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        if status == "SERVING" and self.rest_url and not self._rest_healthy():
            return "REST_NOT_READY"
        return status

    def _rest_healthy(self) -> bool:
        try:
            with _NO_PROXY_OPENER.open(f"{self.rest_url}/health", timeout=PROBE_TIMEOUT_S) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def close(self) -> None:
        self.channel.close()


def admin_credentials(tls_dir: str) -> grpc.ChannelCredentials:
    """The stack's operator identity (health and Stats only, authz.py)."""
    return channel_credentials(TlsFiles(f"{tls_dir}/ca.pem", f"{tls_dir}/admin.pem",
                                        f"{tls_dir}/admin-key.pem"))
