"""A grpc.aio server with health, reflection and a graceful drain on SIGTERM.

Health is NOT_SERVING from start until the service says it is ready, and again while it drains,
so load balancers and `kvrelay up` route around a service that cannot take work.
"""
from __future__ import annotations

import asyncio
import signal
from collections.abc import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from kvrelay.common import tls
from kvrelay.common.log import get_logger

# Internal messages (KV chunks, step batches) can be large; the KV connector chunks its own
# messages under gRPC's 4 MiB default, the rest stays far below this.
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# A `dns:///name:port` target that resolves to several replicas (a Kubernetes headless Service of
# tokenizers) spreads calls over all of them; with one address it behaves like pick_first.
CLIENT_ONLY_OPTIONS = [
    ("grpc.lb_policy_name", "round_robin"),
    # gRPC shares subchannels (connections) among every channel of a process with the same
    # target and arguments. A worker restarted on its old port would then be dialled through
    # the dead one's subchannel, still in reconnect backoff, and a fresh channel's first call
    # fail at once with UNAVAILABLE ("connections to all backends failing"): the chaos suite
    # saw a recovered request burn its whole retry budget that way. Each channel its own.
    ("grpc.use_local_subchannel_pool", 1),
]
SERVER_OPTIONS = CHANNEL_OPTIONS + [
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    # gRPC sets SO_REUSEPORT by default: a second process on the same port would silently take
    # half the connections (a worker started twice splits its step streams). Fail to bind.
    ("grpc.so_reuseport", 0),
]

log = get_logger(__name__)


class ServiceServer:
    """Owns one grpc.aio server: add servicers, `start`, `set_serving`, `wait_for_termination`.

    An internal server (the default) serves with the process's TLS identity when one is
    installed (tls.py): peers need a certificate from the CA, and their role decides what they
    may call (authz.py). The gateway's public server passes `public_credentials` instead (TLS
    for API users, optionally mutual), or None for plaintext."""

    def __init__(self, host: str, port: int, service_names: list[str],
                 extra_options: list[tuple[str, object]] | None = None, public: bool = False,
                 public_credentials: grpc.ServerCredentials | None = None) -> None:
        internal_tls = None if public else tls.installed()
        interceptors = []
        if internal_tls is not None:
            from kvrelay.common.authz import RoleInterceptor  # cryptography only with TLS on
            interceptors.append(RoleInterceptor(internal_tls))
        # gRPC takes the first of repeated options: a service's own come first, to override.
        self.server = grpc.aio.server(options=list(extra_options or []) + SERVER_OPTIONS,
                                      interceptors=interceptors)
        self.health = HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            self.service_names + [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                                  reflection.SERVICE_NAME], self.server)
        credentials = (tls.server_credentials(internal_tls) if internal_tls is not None
                       else public_credentials)
        self.port = (self.server.add_secure_port(f"{host}:{port}", credentials) if credentials
                     else self.server.add_insecure_port(f"{host}:{port}"))
        if self.port == 0:
            raise SystemExit(f"cannot bind {host}:{port}")
        self.stopping = asyncio.Event()
        self.serving = False

    async def start(self) -> None:
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()

    async def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._set_all(status)
        self.serving = serving  # what the metrics port's /health answers

    async def _set_all(self, status) -> None:
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)

    async def serve_until_stopped(self, drain: Callable[[], Awaitable[None]] | None = None,
                                  grace_s: float = 30.0) -> None:
        """Wait for SIGTERM/SIGINT, then go NOT_SERVING, let `drain` finish in-flight work
        (bounded by `grace_s`) and stop."""
        await self.stopping.wait()
        log.info("draining")
        await self.set_serving(False)
        if drain is not None:
            try:
                await asyncio.wait_for(drain(), grace_s)
            except asyncio.TimeoutError:
                log.warning("drain timed out", grace_s=grace_s)
        await self.server.stop(grace=2.0)
        log.info("stopped")


def channel(address: str, peer_role: str,
            extra_options: list[tuple[str, int]] | None = None) -> grpc.aio.Channel:
    """A channel to the internal service of `peer_role` at `address`: mutual TLS with this
    process's identity when one is installed, checking the server holds that role."""
    options = CHANNEL_OPTIONS + CLIENT_ONLY_OPTIONS + (extra_options or [])
    files = tls.installed()
    if files is None:
        return grpc.aio.insecure_channel(address, options=options)
    return grpc.aio.secure_channel(address, tls.channel_credentials(files),
                                   options=options + tls.target_options(peer_role))
