"""The services' Prometheus endpoint, served from their asyncio loop."""
import asyncio
import urllib.error
import urllib.request

from kvrelay.common.metrics import counter, render_metrics
from kvrelay.common.metrics_http import start_metrics_server

SCRAPED = counter("test_scrape_marker", "A counter the scrape must show")


def _request(port: int, method: str, path: str):
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def test_the_endpoint_serves_the_registry_and_refuses_the_rest():
    SCRAPED.inc(3)

    async def scenario():
        server = await start_metrics_server("127.0.0.1", 0, render_metrics)
        port = server.sockets[0].getsockname()[1]
        try:
            return [await asyncio.to_thread(_request, port, method, path) for method, path in
                    (("GET", "/metrics"), ("HEAD", "/metrics"), ("GET", "/other"),
                     ("POST", "/metrics"))]
        finally:
            server.close()
            await server.wait_closed()

    get, head, other, post = asyncio.run(scenario())
    assert get[0] == 200 and get[1]["Content-Type"].startswith("text/plain; version=0.0.4")
    assert b"kvrelay:test_scrape_marker_total 3.0" in get[2]
    assert head[0] == 200 and head[2] == b"" and int(head[1]["Content-Length"]) > 0
    assert other[0] == 404
    assert post[0] == 405


def test_a_client_that_sends_nothing_does_not_stop_the_server():
    async def scenario():
        server = await start_metrics_server("127.0.0.1", 0, render_metrics)
        port = server.sockets[0].getsockname()[1]
        try:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /metr")  # and goes away mid-request
            writer.close()
            return await asyncio.to_thread(_request, port, "GET", "/metrics")
        finally:
            server.close()
            await server.wait_closed()

    status, _, body = asyncio.run(scenario())
    assert status == 200 and b"kvrelay:" in body
