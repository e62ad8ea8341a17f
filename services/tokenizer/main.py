"""`kvrelay tokenizer`: the model's tokenizer as a stateless gRPC service."""
from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from kvrelay.api.kvrelay.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from kvrelay.common.tls import install, tls_files_from_args
from kvrelay.tokenizer.flags import add_arguments  # `kvrelay tokenizer`'s flags (cli.py)
from kvrelay.common.grpc_server import ServiceServer
from kvrelay.common.log import get_logger
from kvrelay.common.metrics import serve_metrics
from kvrelay.common.runtime import run_service

log = get_logger(__name__)
SERVICE_NAME = tokenizer_pb2.DESCRIPTOR.services_by_name["Tokenizer"].full_name


def run(args: argparse.Namespace) -> int:
    run_service("tokenizer", serve(args), args.log_level)
    return 0


def load_tokenizer(model: str | None, chat_template: str | None = None):
    """The model's tokenizer; chat_template: a Jinja file that replaces its chat template."""
    from transformers import AutoTokenizer

    from kvrelay.engine.model_loader import resolve_model_dir
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(model))
    if chat_template is not None:
        tokenizer.chat_template = Path(chat_template).read_text()
    return tokenizer


async def serve(args: argparse.Namespace) -> None:
    install(tls_files_from_args(args))  # this process's identity on every internal hop
    from kvrelay.tokenizer.servicer import TokenizerServicer

    server = ServiceServer(args.host, args.port, [SERVICE_NAME])
    servicer = TokenizerServicer(args.tool_call_parser)
    tokenizer_pb2_grpc.add_TokenizerServicer_to_server(servicer, server.server)
    server.install_signal_handlers()
    await server.start()
    metrics_server = await serve_metrics(args.metrics_port, args.host,
                                         health=lambda: server.serving)
    log.info("tokenizer loading", port=server.port, model=args.model or "default")
    # Loading may convert a GGUF (many seconds): off the loop, so health answers meanwhile.
    servicer.load(await asyncio.to_thread(load_tokenizer, args.model, args.chat_template))
    await server.set_serving(True)
    log.info("tokenizer serving", port=server.port, vocab_size=servicer.vocab_size,
             tool_call_format=servicer.tool_call_format)
    await server.serve_until_stopped()
    if metrics_server is not None:
        metrics_server.close()
