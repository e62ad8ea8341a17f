"""`kvrelay gateway`: OpenAI REST (uvicorn) and the public gRPC API in one asyncio loop."""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import uuid

from kvrelay.api.kvrelay.v1 import generation_pb2
from kvrelay.common.flags import add_flag
from kvrelay.common.tls import add_tls_flags, install, tls_files_from_args
from kvrelay.gateway.public_tls import add_public_tls_flags, public_tls_from_args
from kvrelay.common.log import get_logger
from kvrelay.common.runtime import run_service
from kvrelay.gateway.limits import RequestLimits, add_limit_flags

log = get_logger(__name__)
SERVICE_NAME = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_flag(parser, "--host", default="0.0.0.0", help="address to bind (REST and gRPC)")
    add_flag(parser, "--port", type=int, default=8000, help="OpenAI REST port")
    add_flag(parser, "--grpc-port", type=int, default=50050, help="public gRPC API port")
    add_flag(parser, "--tokenizer-address", default="127.0.0.1:50051",
             help="host:port of the tokenizer service")
    add_flag(parser, "--scheduler-address", default="127.0.0.1:50052",
             help="host:port of the scheduler; comma-separated for several scheduler groups "
                  "(each request goes to the least loaded)")
    add_flag(parser, "--served-model-name", default=None,
             help="model name clients use (default: the scheduler's model)")
    add_flag(parser, "--api-key", default=None,
             help="require 'Authorization: Bearer <key>' (REST) / authorization metadata (gRPC)")
    add_flag(parser, "--gateway-id", default=None,
             help="this gateway's id at the scheduler (default: random)")
    add_flag(parser, "--submit-wait-timeout", type=float, default=10.0,
             help="seconds a new request waits for a ready scheduler group (one restarting, "
                  "or whose workers are) before the 503; 0: answer at once")
    add_flag(parser, "--request-timeout", type=float, default=0.0,
             help="seconds a request may run; past it, what it has not finished is aborted and "
                  "it ends with a timeout error (504; an SSE error event once streaming; gRPC "
                  "DEADLINE_EXCEEDED). 0: no deadline")
    add_flag(parser, "--tokenizer-wait-timeout", type=float, default=30.0,
             help="seconds the requests in flight wait for a lost tokenizer (its Detokenize "
                  "stream broke) to come back; it gets their detokenizer states again and their "
                  "streams go on. Past it they end with an error and are aborted (> 0)")
    add_limit_flags(parser)  # what one request may ask for (limits.py)
    add_flag(parser, "--log-request-text", action="store_true",
             help="log prompts, outputs and their token ids (debugging; off: they are the "
                  "users' data)")
    add_flag(parser, "--metrics-port", type=int, default=9100,
             help="Prometheus /metrics and /health, off the public ports (0: off)")
    add_tls_flags(parser)
    add_public_tls_flags(parser)
    add_flag(parser, "--log-level", default="info", help="debug, info, warning, error")


def run(args: argparse.Namespace) -> int:
    run_service("gateway", serve(args), args.log_level)
    return 0


async def serve(args: argparse.Namespace) -> None:
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
    from kvrelay.gateway.rest_server import RestServer
    from kvrelay.gateway.upstream import Upstream

    gateway_id = args.gateway_id or f"gateway-{uuid.uuid4().hex[:12]}"
    schedulers = [address.strip() for address in args.scheduler_address.split(",")
                  if address.strip()]
    core = GatewayCore(Upstream(args.tokenizer_address, schedulers), gateway_id,
                       args.served_model_name, submit_wait_s=args.submit_wait_timeout,
                       request_timeout_s=args.request_timeout,
                       tokenizer_wait_s=args.tokenizer_wait_timeout,
                       limits=RequestLimits.from_args(args), log_request_text=args.log_request_text)
    server = ServiceServer(args.host, args.grpc_port, [SERVICE_NAME], public=True,
                           public_credentials=public_tls and public_tls.grpc_credentials(),
                           extra_options=core.limits.grpc_server_options())
    add_generation_service(GenerationServicer(core, args.api_key), server.server)
    app = build_app(core, args.api_key)

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

