"""A real HTTP server on a localhost port that streams OpenAI-format SSE with known timings:
the stand-in for "any OpenAI-compatible server" in the `bench serve` tests.

Each response sends the role-only delta at once, the first token `ttft` seconds after the
request, then one token every `itl` seconds, then usage (when asked for and `send_usage`) and
[DONE]. A request may carry `fake_ttft` / `fake_itl` (a JSONL workload passes extra fields
through) to get its own timings.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class FakeBehaviour:
    ttft: float = 0.1
    itl: float = 0.02
    send_usage: bool = True
    reject_fields: set = field(default_factory=set)  # answer 422 when one of these is present
    bodies: list = field(default_factory=list)       # every request body received


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    behaviour: FakeBehaviour

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_GET(self):
        if self.path == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": "fake-model"}]})
        else:
            self._json(404, {"error": "not found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.behaviour.bodies.append(body)
        rejected = self.behaviour.reject_fields & set(body)
        if rejected:
            self._json(422, {"detail": f"Unexpected fields in the request: {rejected}"})
            return
        chat = self.path == "/v1/chat/completions"
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        try:
            self._stream(body, chat)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client hung up (a time limit): a server just stops

    def _stream(self, body: dict, chat: bool) -> None:
        began = time.perf_counter()
        ttft = body.get("fake_ttft", self.behaviour.ttft)
        itl = body.get("fake_itl", self.behaviour.itl)
        if chat:
            self._event({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                             "content": ""}}]})
        for index in range(body["max_tokens"]):
            _sleep_until(began + ttft + index * itl)
            piece = {"delta": {"content": f" t{index}"}} if chat else {"text": f" t{index}"}
            self._event({"choices": [{"index": 0, **piece}]})
        wants_usage = (body.get("stream_options") or {}).get("include_usage")
        if wants_usage and self.behaviour.send_usage:
            self._event({"choices": [], "usage": {"prompt_tokens": 7,
                                                  "completion_tokens": body["max_tokens"]}})
        self._chunk(b"data: [DONE]\n\n")
        self._chunk(b"")

    def _event(self, payload: dict) -> None:
        self._chunk(f"data: {json.dumps(payload)}\n\n".encode())

    def _chunk(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def _json(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _sleep_until(deadline: float) -> None:
    delay = deadline - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


class FakeServer:
    def __init__(self, behaviour: FakeBehaviour | None = None) -> None:
        self.behaviour = behaviour or FakeBehaviour()
        handler = type("Handler", (_Handler,), {"behaviour": self.behaviour})
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> "FakeServer":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
