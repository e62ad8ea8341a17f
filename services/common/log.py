"""structlog set-up (JSON when stderr is not a terminal) and the request id carried across hops.

The request id travels in gRPC metadata under `x-request-id`; each service binds it to a context
variable so that every log line of that request carries it.
"""
from __future__ import annotations

import logging
import sys
import urllib.parse

import structlog

REQUEST_ID_KEY = "x-request-id"


def setup_logging(service: str, level: str = "info") -> None:
    renderer = (structlog.dev.ConsoleRenderer(colors=False) if sys.stderr.isatty()
                else structlog.processors.JSONRenderer())
    # Library loggers (grpc, asyncio) stay at warning: their debug output is noise here.
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(message)s")
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)


def get_logger(name: str | None = None):
    return structlog.get_logger(name)


def request_id_from(context) -> str | None:
    """The request id in an incoming gRPC call's metadata, if any."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_KEY:
            return value
    return None


def bind_request_id(request_id: str | None) -> None:
    if request_id:
        structlog.contextvars.bind_contextvars(request_id=request_id)


def request_metadata(request_id: str | None) -> tuple[tuple[str, str], ...]:
    """Metadata for an outgoing call on behalf of one request. gRPC metadata values are
    printable ASCII: any other character (a REST client's X-Request-Id may hold Latin-1) goes
    percent-encoded, never failing the call."""
    if not request_id:
        return ()
    if not request_id.isascii() or not request_id.isprintable():
        request_id = urllib.parse.quote(request_id, safe="")
    return ((REQUEST_ID_KEY, request_id),)
