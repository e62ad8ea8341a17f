"""Killing the decode worker mid-stream ends every affected stream with an error, never a hang,
and `kvrelay up` reports the death and stops the stack. Runs last, on a stack of its own."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.stack import start_stack, stop_and_check

NUM_STREAMS = 3
STREAM_END_DEADLINE_S = 30
UP_EXIT_DEADLINE_S = 90

pytestmark = pytest.mark.breaks_stack


@pytest.fixture(scope="module")
def doomed_stack(tmp_path_factory):
    stack = start_stack("pd", tmp_path_factory.mktemp("doomed-stack"))
    yield stack
    stop_and_check(stack, expected_code=1)  # a child died: `up` failed, and left no orphans


class Stream(threading.Thread):
    """One long streaming chat request, recording how it ended."""

    def __init__(self, base_url: str, model: str, index: int) -> None:
        super().__init__(daemon=True)
        self.url = f"{base_url}/chat/completions"
        self.body = {"model": model, "stream": True, "max_tokens": 2000, "ignore_eos": True,
                     "messages": [{"role": "user", "content": f"Tell me a long story ({index})."}]}
        self.streaming = threading.Event()  # a few tokens have arrived
        self.num_chunks = 0
        self.error_event: dict | None = None
        self.saw_done = False
        self.failure: Exception | None = None

    def run(self) -> None:
        try:
            with httpx.Client(timeout=STREAM_END_DEADLINE_S * 2, trust_env=False) as http:
                with http.stream("POST", self.url, json=self.body) as response:
                    if response.status_code != 200:
                        self.error_event = {"status": response.status_code}
                        return
                    for line in response.iter_lines():
                        self._on_line(line)
        except httpx.HTTPError as exc:
            self.failure = exc
        finally:
            self.streaming.set()

    def _on_line(self, line: str) -> None:
        if line == "data: [DONE]":
            self.saw_done = True
        elif line.startswith("data: "):
            event = json.loads(line[6:])
            if "error" in event:
                self.error_event = event
            else:
                self.num_chunks += 1
                if self.num_chunks >= 3:
                    self.streaming.set()

    def ended_with_error(self) -> bool:
        return self.error_event is not None or (self.failure is not None and not self.saw_done)


def test_killing_the_decode_worker_errors_streams_instead_of_hanging(doomed_stack):
    model = httpx.get(f"{doomed_stack.base_url}/models", trust_env=False).json()["data"][0]["id"]
    streams = [Stream(doomed_stack.base_url, model, i) for i in range(NUM_STREAMS)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.streaming.wait(120), "the stream never started"
        assert stream.num_chunks >= 3 and stream.error_event is None, "failed before the kill"
    os.kill(doomed_stack.service("decode-0")["pid"], signal.SIGKILL)
    killed_at = time.monotonic()
    for stream in streams:
        stream.join(max(0.0, killed_at + STREAM_END_DEADLINE_S - time.monotonic()))
    assert not any(stream.is_alive() for stream in streams), \
        f"streams still open {STREAM_END_DEADLINE_S}s after the decode worker died"
    for stream in streams:
        assert stream.ended_with_error(), (stream.num_chunks, stream.saw_done, stream.failure)
    # `up` notices the death, names the worker and stops the whole stack with an error.
    assert doomed_stack.process.wait(UP_EXIT_DEADLINE_S) == 1
    assert "decode-0 exited" in doomed_stack.up_log()
