"""A dead decode worker costs no request. Greedy streams are running through PD when the
decode worker is SIGKILLed: each one pauses while `kvrelay up` restarts the worker, is
re-prefilled (its prompt and the tokens so far), goes on without an error event, and ends with
the very text of an uninterrupted run: no token repeated, none skipped. Afterwards the stack
serves as before and every block is free. On a stack of its own; in `make chaos`, since a model
reload under backoff takes most of a minute of `make test`'s budget (the recovery itself is
tested there on the cluster core, tests/services/test_cluster_scheduler.py)."""
from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from tests.e2e.stack import metric_values, start_stack, stop_and_check

NUM_STREAMS = 3
MAX_TOKENS = 96
HEAL_DEADLINE_S = 240  # the restart's backoff, a model load, the re-prefill


@pytest.fixture(scope="module")
def doomed_stack(tmp_path_factory):
    stack = start_stack("pd", tmp_path_factory.mktemp("doomed-stack"))
    yield stack
    stop_and_check(stack)  # healed: a clean stop, and no orphans (the dead worker's included)


def _body(model: str, index: int, stream: bool) -> dict:
    return {"model": model, "stream": stream, "max_tokens": MAX_TOKENS, "ignore_eos": True,
            "temperature": 0.0,
            "messages": [{"role": "user", "content": f"Tell me a long story ({index})."}]}


class Stream(threading.Thread):
    """One greedy streaming chat request, recording its text and how it ended."""

    def __init__(self, base_url: str, model: str, index: int) -> None:
        super().__init__(daemon=True)
        self.url = f"{base_url}/chat/completions"
        self.body = _body(model, index, stream=True)
        self.streaming = threading.Event()  # a few tokens have arrived
        self.pieces: list[str] = []
        self.error_event: dict | None = None
        self.saw_done = False
        self.failure: Exception | None = None

    def run(self) -> None:
        try:
            with httpx.Client(timeout=HEAL_DEADLINE_S, trust_env=False) as http:
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
                return
            delta = event["choices"][0]["delta"].get("content")
            if delta:
                self.pieces.append(delta)
            if len(self.pieces) >= 8:
                self.streaming.set()


def test_a_killed_decode_worker_costs_no_stream(doomed_stack):
    base_url = doomed_stack.base_url
    model = httpx.get(f"{base_url}/models", trust_env=False).json()["data"][0]["id"]
    with httpx.Client(timeout=120, trust_env=False) as http:  # the uninterrupted runs
        expected = [http.post(f"{base_url}/chat/completions", json=_body(model, i, False))
                    .json()["choices"][0]["message"]["content"] for i in range(NUM_STREAMS)]
    streams = [Stream(base_url, model, i) for i in range(NUM_STREAMS)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.streaming.wait(120), "the stream never started"
        assert stream.error_event is None and not stream.saw_done, "ended before the kill"
    dead_pid = doomed_stack.service("decode-0")["pid"]
    os.kill(dead_pid, signal.SIGKILL)
    for stream in streams:
        stream.join(HEAL_DEADLINE_S)
    assert not any(stream.is_alive() for stream in streams), doomed_stack.up_log()
    for index, stream in enumerate(streams):
        assert stream.error_event is None and stream.failure is None, \
            (stream.error_event, stream.failure)
        assert stream.saw_done
        assert "".join(stream.pieces) == expected[index]  # nothing repeated, nothing skipped

    # `up` named the death and restarted the worker, which registered and took the work.
    log = doomed_stack.up_log()
    assert "decode-0 exited with code -9 while serving; restarting it in 1s" in log, log
    assert "decode-0   SERVING again" in log, log
    state = doomed_stack.state
    assert state["status"] == "ready" and state["services"]["decode-0"]["restarts"] == 1
    assert state["services"]["decode-0"]["pid"] != dead_pid
    reply = httpx.post(f"{base_url}/chat/completions", trust_env=False, timeout=120,
                       json=_body(model, 0, stream=False))
    assert reply.status_code == 200 and reply.json()["choices"][0]["message"]["content"] == \
        expected[0]
    _wait_for_free_blocks(doomed_stack)
    # Every stream was recovered once, and the scheduler's metrics say so.
    recoveries = metric_values(doomed_stack.service("scheduler")["metrics_url"],
                               "kvrelay:request_recoveries_total")
    assert sum(recoveries.values()) >= NUM_STREAMS, recoveries


def _wait_for_free_blocks(stack, timeout_s: float = 30.0) -> None:
    """Every worker's pool is whole again once the requests are done (the scheduler's Stats)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = stack.scheduler_stats()
        busy = [(w.worker_id, w.num_free_blocks, w.num_blocks) for w in stats.workers
                if w.num_free_blocks != w.num_blocks]
        if not busy:
            return
        assert time.monotonic() < deadline, busy
        time.sleep(0.5)
