"""The Prometheus endpoint of a service, served by its asyncio loop.

prometheus_client's own server is a thread that wakes twice a second to check for shutdown. On
this kind of machine every wakeup of an idle process costs about a millisecond of CPU that the
model's threads lose, so the scrape endpoint lives on the loop that is awake anyway."""
from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

MAX_HEAD_BYTES = 16 << 10
READ_TIMEOUT_S = 10.0
METRICS_PATHS = ("/metrics", "/")
HEALTH_PATH = "/health"
# The text format generate_latest() writes (prometheus_client's CONTENT_TYPE_LATEST may name a
# newer one it only writes on negotiation).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


async def start_metrics_server(host: str, port: int, render: Callable[[], bytes],
                               health: Callable[[], bool] | None = None) -> asyncio.Server:
    """Answer `GET /metrics` (and `/`) with `render()` and `GET /health` with 200 when
    `health()` holds (503 otherwise); one request per connection."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT_S)
            writer.write(_response(head, render, health))
            await writer.drain()
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, asyncio.TimeoutError,
                ConnectionError):
            pass  # a client that went away or sent no request gets nothing
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    return await asyncio.start_server(handle, host, port, limit=MAX_HEAD_BYTES)


def _response(head: bytes, render: Callable[[], bytes],
              health: Callable[[], bool] | None) -> bytes:
    method, _, rest = head.partition(b" ")
    path = rest.split(b" ", 1)[0].split(b"?", 1)[0].decode("latin-1")
    if method not in (b"GET", b"HEAD"):
        return _message(405, "Method Not Allowed", b"only GET\n", b"Allow: GET, HEAD\r\n")
    if path == HEALTH_PATH and health is not None:
        return (_message(200, "OK", b"serving\n") if health()
                else _message(503, "Service Unavailable", b"not serving\n"))
    if path not in METRICS_PATHS:
        return _message(404, "Not Found", b"metrics are at /metrics\n")
    body = render()
    head_only = method == b"HEAD"
    return (f"HTTP/1.1 200 OK\r\nContent-Type: {CONTENT_TYPE}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + (
        b"" if head_only else body)


def _message(status: int, reason: str, body: bytes, extra_headers: bytes = b"") -> bytes:
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n").encode() + extra_headers + (
        b"\r\n" + body)
