"""`kvrelay gateway`: OpenAI REST (uvicorn) and the public gRPC API in one asyncio loop."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import uuid

from kvrelay.api.kvrelay.v1 import generation_pb2
from kvrelay.common.tls import install, tls_files_from_args
from kvrelay.gateway.public_tls import public_tls_from_args
from kvrelay.common.log import get_logger
from kvrelay.common.runtime import run_service
from kvrelay.gateway.flags import add_arguments  # `kvrelay gateway`'s flags (cli.py)
from kvrelay.gateway.limits import RequestLimits

log = get_logger(__name__)
SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def run(args: argparse.Namespace) -> int:
    run_service("gateway", serve(args), args.log_level)
    return 0


async def serve(args: argparse.Namespace) -> None:
    if args.responses_store_bytes < 0 or args.responses_store_ttl <= 0:
        raise SystemExit(f"--responses-store-bytes must be >= 0 and --responses-store-ttl > 0, "
                         f"got {args.responses_store_bytes} and {args.responses_store_ttl}")
    if args.tokenizer_wait_timeout <= 0:  # a new stream's first answer takes a moment too
        raise SystemExit(f"--tokenizer-wait-timeout must be positive, "
                         f"got {args.tokenizer_wait_timeout}")
    install(tls_files_from_args(args))  # this process's identity on every internal hop
    public_tls = public_tls_from_args(args)
    from kvrelay.common.grpc_server import ServiceServer
    from kvrelay.common.metrics import serve_metrics
    from kvrelay.gateway.app import build_app
    from kvrelay.gateway.core import GatewayCore
    from kvrelay.gateway.grpc_api import GenerationServicer, add_generation_service
    from kvrelay.gateway.responses_store import ResponseStore
    from kvrelay.gateway.rest_server import RestServer
    from kvrelay.gateway.upstream import Upstream

    gateway_id = args.gateway_id or f"gateway-{uuid.uuid4().hex[:12]}"
    schedulers = [address.strip() for address in args.scheduler_address.split(",")
                  if address.strip()]
    core = GatewayCore(Upstream(args.tokenizer_address, schedulers), gateway_id,
                       args.served_model_name, submit_wait_s=args.submit_wait_timeout,
                       request_timeout_s=args.request_timeout,
                       tokenizer_wait_s=args.tokenizer_wait_timeout,
                       limits=RequestLimits.from_args(args), log_request_text=args.log_request_text,
                       reasoning_parser=args.reasoning_parser, pooling=args.pooling)
    server = ServiceServer(args.host, args.grpc_port, [SERVICE_NAME], public=True,
                           public_credentials=public_tls and public_tls.grpc_credentials(),
                           extra_options=core.limits.grpc_server_options())
    add_generation_service(GenerationServicer(core, args.api_key), server.server)
    app = build_app(core, ResponseStore.from_args(args), args.api_key)

    async def follow_health(ready: bool) -> None:
        if not server.stopping.is_set():  # while draining it stays NOT_SERVING
            await server.set_serving(ready)

    async def drain() -> None:
        app.state.draining = True
        await core.drain()

    core.on_health_change.append(follow_health)
    server.install_signal_handlers()
    await server.start()
    await core.start()
    metrics_server = await serve_metrics(
        args.metrics_port, args.host, health=lambda: core.ready and not app.state.draining)
    http = RestServer(app, args.host, args.port,
                      public_tls.uvicorn_options() if public_tls else None)
    http_task = asyncio.create_task(http.serve())
    http_task.add_done_callback(lambda _: server.stopping.set())  # e.g. the port is taken
    log.info("gateway started", rest_port=args.port, grpc_port=server.port,
             gateway_id=gateway_id)
    await server.serve_until_stopped(drain)
    http.request_exit()
    with contextlib.suppress(BaseException):
        await http_task
    await core.stop()
    if metrics_server is not None:
        metrics_server.close()

