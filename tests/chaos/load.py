"""Load for the chaos suite: greedy streams checked against undisturbed references, a storm
of disconnects, and the checks that the stack healed."""
from __future__ import annotations

import json
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import httpx

HEAL_TIMEOUT_S = 240


def _body(model: str, index: int, max_tokens: int, stream: bool) -> dict:
    return {"model": model, "stream": stream, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0.0,
            "messages": [{"role": "user", "content": f"Write about topic number {index}."}]}


class GreedyLoad:
    """num_prompts greedy requests; their undisturbed texts are taken once, up front."""

    def __init__(self, base_url: str, num_prompts: int, max_tokens: int) -> None:
        self.base_url = base_url
        with httpx.Client(timeout=120, trust_env=False) as http:
            self.model = http.get(f"{base_url}/models").json()["data"][0]["id"]
            self.bodies = [_body(self.model, i, max_tokens, True) for i in range(num_prompts)]
            self.expected = [http.post(f"{base_url}/chat/completions",
                                       json={**body, "stream": False})
                             .json()["choices"][0]["message"]["content"]
                             for body in self.bodies]

    def start(self) -> "LoadRun":
        return LoadRun(self)


class LoadRun:
    """Every prompt streamed at once, each on its own thread."""

    def __init__(self, load: GreedyLoad) -> None:
        self.load = load
        self.texts: list[list[str]] = [[] for _ in load.bodies]
        self.times: list[list[float]] = [[] for _ in load.bodies]  # monotonic, per piece
        self.errors: list[object] = [None] * len(load.bodies)
        self.threads = [threading.Thread(target=self._stream, args=(i,), daemon=True)
                        for i in range(len(load.bodies))]
        for thread in self.threads:
            thread.start()

    def _stream(self, index: int) -> None:
        url = f"{self.load.base_url}/chat/completions"
        try:
            with httpx.Client(timeout=HEAL_TIMEOUT_S, trust_env=False) as http:
                with http.stream("POST", url, json=self.load.bodies[index]) as response:
                    if response.status_code != 200:
                        self.errors[index] = f"HTTP {response.status_code}"
                        return
                    for line in response.iter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            self.errors[index] = event
                            return
                        piece = event["choices"][0]["delta"].get("content")
                        if piece:
                            self.texts[index].append(piece)
                            self.times[index].append(time.monotonic())
        except httpx.HTTPError as exc:
            self.errors[index] = exc

    def join(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        assert not any(t.is_alive() for t in self.threads), "a stream hung"

    def check_exact(self, timeout_s: float) -> None:
        self.join(timeout_s)
        assert self.errors == [None] * len(self.errors), self.errors
        got = ["".join(pieces) for pieces in self.texts]
        assert got == self.load.expected


    def gaps_after(self, moment: float) -> list[float]:
        """Seconds from `moment` (monotonic) to each stream's first piece after it, for the
        streams still going then: how long a fault held them (the first token after it)."""
        return [min(t for t in times if t > moment) - moment
                for times in self.times if times and times[-1] > moment]

    def check_exact_or_cut(self, timeout_s: float) -> int:
        """Each stream either ended with the undisturbed text or lost its connection (its
        gateway died): never a hang, never a wrong text. Returns how many were cut."""
        return self._exact_or(timeout_s, lambda error: isinstance(error, httpx.HTTPError))

    def check_exact_or_clear_error(self, timeout_s: float) -> int:
        """Each stream either ended with the undisturbed text or with an error event (never a
        hang, never a wrong text); returns how many ended with an error."""
        return self._exact_or(timeout_s, lambda error: isinstance(error, dict)
                              and bool(error["error"]["message"]))

    def _exact_or(self, timeout_s: float, acceptable) -> int:
        """Streams without an error have the undisturbed text; the others' errors are
        `acceptable`. Returns how many ended with one."""
        self.join(timeout_s)
        num_errors = 0
        for index, error in enumerate(self.errors):
            if error is None:
                assert "".join(self.texts[index]) == self.load.expected[index]
            else:
                assert acceptable(error), error
                num_errors += 1
        return num_errors


def abort_storm(base_url: str, model: str, num_requests: int, concurrency: int,
                rng: random.Random) -> None:
    """num_requests streams, each dropped by its client after a random few chunks (or before
    the first): the gateway must abort each one and free what it held."""
    cut_after = [rng.randint(0, 6) for _ in range(num_requests)]

    def one(index: int) -> None:
        body = _body(model, index % 50, 200, True)
        with httpx.Client(timeout=60, trust_env=False) as http:
            with http.stream("POST", f"{base_url}/chat/completions", json=body) as response:
                seen = 0
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        seen += 1
                    if seen > cut_after[index]:
                        return  # closing the response drops the connection

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(num_requests)))


def wait_healed(stack, restarted: str | None) -> None:
    """The stack reports ready (the victim restarted once more, where one was killed), every
    worker's blocks are free, and nothing runs or waits."""
    deadline = time.monotonic() + HEAL_TIMEOUT_S
    while True:
        state = stack.state
        try:
            stats = stack.scheduler_stats()
            busy = [(w.worker_id, w.num_free_blocks, w.num_blocks, w.num_running)
                    for w in stats.workers if w.num_free_blocks != w.num_blocks or w.num_running]
            workers = {w.worker_id for w in stats.workers}
        except grpc.RpcError as exc:  # the scheduler itself is restarting
            busy, workers = [f"scheduler: {exc.code().name}"], set()
        # every worker back in the scheduler's registry (a restarted scheduler starts empty)
        missing = set(stack.workers()) - workers
        if state["status"] == "ready" and not busy and not missing:
            break
        assert time.monotonic() < deadline, (state["status"], busy, missing)
        time.sleep(0.5)
    if restarted is not None:
        assert state["services"][restarted]["restarts"] >= 1
