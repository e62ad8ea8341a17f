"""The gateway in a real stack (scheduler, one `--role both` worker, tokenizer, gateway, each its
own process): stop strings through streaming, many prompts with echo, request ids, the public
gRPC client, aborts on disconnect or early exit that free every block, and faults between a
gateway and its upstreams: a SIGKILLed tokenizer (restarted, or gone for good) and a half-open
cut of a scheduler's Outputs stream."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest

from kvrelay.api.kvrelay.v1 import scheduler_pb2, scheduler_pb2_grpc
from kvrelay.client import KvrelayClient, KvrelayError
from tests.services.conftest import ServiceProcess, free_port, grpc_health, stop_all
from tests.services.tcp_proxy import TcpProxy

STORY = [{"role": "user", "content": "Write a short story about a lighthouse keeper."}]
LONG = {"max_tokens": 400, "ignore_eos": True}


@dataclass
class Stack:
    rest_url: str
    grpc_address: str
    scheduler_address: str

    def scheduler_stats(self) -> scheduler_pb2.StatsResponse:
        with grpc.insecure_channel(self.scheduler_address) as channel:
            return scheduler_pb2_grpc.SchedulerStub(channel).Stats(scheduler_pb2.StatsRequest(),
                                                                   timeout=5)

    def wait_idle(self, timeout: float = 1.0) -> scheduler_pb2.StatsResponse:
        """Stats once nothing runs and every block is free, or the last Stats at the timeout."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.scheduler_stats()
            idle = stats.num_running == 0 and stats.num_waiting == 0 and all(
                w.num_free_blocks == w.num_blocks for w in stats.workers)
            if idle or time.monotonic() > deadline:
                return stats
            time.sleep(0.05)


@pytest.fixture(scope="module")
def stack(tokenizer_address, tmp_path_factory) -> Stack:
    logs = tmp_path_factory.mktemp("stack")
    scheduler_port, worker_port, rest_port, grpc_port = (free_port() for _ in range(4))
    scheduler_address = f"127.0.0.1:{scheduler_port}"
    common = ["--host", "127.0.0.1", "--log-level", "warning"]
    services = [
        ServiceProcess("scheduler", [*common, "--port", str(scheduler_port), "--metrics-port",
                                     "0"], logs / "scheduler.log"),
        ServiceProcess("worker", [*common, "--role", "both", "--port", str(worker_port),
                                  "--scheduler-address", scheduler_address, "--metrics-port", "0",
                                  "--dtype", "float32", "--num-kv-blocks", "512"],
                       logs / "worker.log"),
        ServiceProcess("gateway", [*common, "--port", str(rest_port), "--grpc-port",
                                   str(grpc_port), "--tokenizer-address", tokenizer_address,
                                   "--scheduler-address", scheduler_address,
                                   "--metrics-port", "0"],
                       logs / "gateway.log")]
    rest_url = f"http://127.0.0.1:{rest_port}"
    try:
        services[-1].wait_for(lambda: _healthy(rest_url), "gateway with a ready stack", 180)
        yield Stack(rest_url, f"127.0.0.1:{grpc_port}", scheduler_address)
    finally:
        stop_all(services)


def _healthy(rest_url: str) -> bool:
    try:
        return httpx.get(f"{rest_url}/health", timeout=1, trust_env=False).status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.rest_url}/v1", api_key="unused", max_retries=0,
                         timeout=60)


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 60))


def test_health_is_serving(stack):
    assert grpc_health(stack.grpc_address) == "SERVING"


def test_stop_string_is_never_streamed_and_counts_tokens_through_it(stack, client, tokenizer):
    async def greedy(**options):
        async with KvrelayClient(stack.grpc_address) as kv:
            return await kv.chat(STORY, temperature=0, max_tokens=24, **options)

    full = run(greedy())
    text, tokens = full.text, full.choices[0].token_ids
    stop = text[len(text) // 2:len(text) // 2 + 5]  # five characters mid-text, across tokens
    expected = text[:text.index(stop)]
    through_stop = next(k for k in range(1, len(tokens) + 1)
                        if stop in tokenizer.decode(tokens[:k], skip_special_tokens=True))
    args = dict(model=client.models.list().data[0].id, messages=STORY, temperature=0,
                max_tokens=24, stop=[stop])
    chunks = list(client.chat.completions.create(
        stream=True, stream_options={"include_usage": True}, **args))
    deltas = [c.choices[0].delta.content or "" for c in chunks if c.choices]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(deltas) == expected
    assert all(stop not in "".join(deltas[:i + 1]) for i in range(len(deltas)))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == through_stop
    whole = client.chat.completions.create(**args)
    assert whole.choices[0].message.content == expected
    assert whole.choices[0].finish_reason == "stop"
    assert whole.usage.completion_tokens == through_stop
    assert whole.choices[0].model_extra["stop_reason"] == stop


def test_many_prompts_with_n_and_echo_stream_every_choice(stack, client):
    prompts = ["The capital of France is", "Once upon a time"]
    args = dict(model=client.models.list().data[0].id, prompt=prompts, n=2, temperature=0,
                max_tokens=6, echo=True)
    whole = client.completions.create(**args)
    assert [c.index for c in whole.choices] == [0, 1, 2, 3]
    for choice in whole.choices:
        assert choice.text.startswith(prompts[choice.index // 2])
        assert len(choice.text) > len(prompts[choice.index // 2])
    streamed = {}
    last = None
    for chunk in client.completions.create(stream=True,
                                           stream_options={"include_usage": True}, **args):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + choice.text
        last = chunk
    assert streamed == {c.index: c.text for c in whole.choices}
    assert last.usage.prompt_tokens == whole.usage.prompt_tokens
    assert last.usage.completion_tokens == whole.usage.completion_tokens == 4 * 6


def test_request_id_is_honoured(stack):
    body = {"messages": STORY, "max_tokens": 2}
    response = httpx.post(f"{stack.rest_url}/v1/chat/completions", json=body, timeout=60,
                          headers={"X-Request-Id": "trace-123"}, trust_env=False)
    assert response.status_code == 200
    assert response.headers["x-request-id"] == "trace-123" == response.json()["id"]
    generated = httpx.post(f"{stack.rest_url}/v1/completions", json={"prompt": "Hi",
                           "max_tokens": 2}, timeout=60, trust_env=False)
    assert generated.headers["x-request-id"].startswith("cmpl-")


def test_client_streams_what_complete_returns(stack, tokenizer):
    async def scenario():
        async with KvrelayClient(stack.grpc_address) as kv:
            models = await kv.list_models()
            ids = await kv.tokenize("Hello 世界")
            chunks = [c async for c in kv.generate("The capital of France is", max_tokens=10,
                                                   temperature=0)]
            whole = await kv.complete("The capital of France is", max_tokens=10, temperature=0)
            with pytest.raises(KvrelayError) as bad:
                await kv.complete("Hi", top_p=2.0)
            return models, ids, chunks, whole, bad.value

    models, ids, chunks, whole, bad = run(scenario())
    assert models[0].id and models[0].max_model_len > 0
    assert ids == tokenizer.encode("Hello 世界")
    assert "".join(c.text for c in chunks) == whole.text
    assert [t for c in chunks for t in c.token_ids] == whole.choices[0].token_ids
    assert chunks[0].prompt_token_ids == tokenizer.encode("The capital of France is")
    assert chunks[-1].usage.completion_tokens == len(whole.choices[0].token_ids) == 10
    assert chunks[-1].finish_reason == whole.finish_reason == "length"
    assert bad.code == "INVALID_ARGUMENT" and "top_p" in bad.message


def test_abort_by_id_ends_the_request_with_abort(stack):
    async def scenario():
        async with KvrelayClient(stack.grpc_address) as kv:
            stream = kv.generate("Tell me everything", request_id="doomed", **LONG)
            chunks = [await anext(stream)]  # aborted once its first token is out, however slow
            found = await kv.abort("doomed")
            chunks += [chunk async for chunk in stream]
            return found, chunks, await kv.abort("doomed")

    found, chunks, found_again = run(scenario())
    assert found and not found_again
    assert chunks[-1].finish_reason == "abort"
    assert 0 < chunks[-1].usage.completion_tokens < LONG["max_tokens"]
    stats = stack.wait_idle()
    assert stats.num_running == 0


def test_leaving_early_frees_every_block(stack):
    async def leave_grpc_stream():
        async with KvrelayClient(stack.grpc_address) as kv:
            stream = kv.generate("Tell me everything", **LONG)
            async with contextlib.aclosing(stream):
                async for _ in stream:
                    break

    run(leave_grpc_stream())
    stats = stack.wait_idle()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    with pytest.raises(httpx.ReadTimeout):  # a non-streaming client that gives up
        httpx.post(f"{stack.rest_url}/v1/chat/completions", json={"messages": STORY, **LONG},
                   timeout=1.0, trust_env=False)
    stats = stack.wait_idle()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert all(w.num_free_blocks == w.num_blocks for w in stats.workers)


def test_a_request_past_the_gateways_deadline_ends_with_a_timeout_and_frees_its_blocks(
        stack, tokenizer_address, tmp_path):
    """A second gateway on the same scheduler, with --request-timeout 1."""
    rest_port, grpc_port = free_port(), free_port()
    gateway = ServiceProcess("gateway", [
        "--host", "127.0.0.1", "--log-level", "warning", "--port", str(rest_port),
        "--grpc-port", str(grpc_port), "--tokenizer-address", tokenizer_address,
        "--scheduler-address", stack.scheduler_address, "--request-timeout", "1",
        "--metrics-port", "0"],
        tmp_path / "gateway.log")
    rest_url = f"http://127.0.0.1:{rest_port}"
    try:
        gateway.wait_for(lambda: _healthy(rest_url), "the gateway with a deadline", 60)
        body = {"model": "unused", "messages": STORY, "max_tokens": 4000, "ignore_eos": True}
        with httpx.Client(base_url=rest_url, timeout=60, trust_env=False) as http:
            model = http.get("/v1/models").json()["data"][0]["id"]
            started = time.monotonic()
            whole = http.post("/v1/chat/completions", json={**body, "model": model})
            assert whole.status_code == 504, whole.text
            assert "deadline of 1 s" in whole.json()["error"]["message"]
            assert 1.0 <= time.monotonic() - started < 10
            events = []
            with http.stream("POST", "/v1/chat/completions",
                             json={**body, "model": model, "stream": True}) as response:
                assert response.status_code == 200
                events = [line for line in response.iter_lines() if line.startswith("data: ")]
            assert "deadline of 1 s" in events[-2] and events[-1] == "data: [DONE]"
        stats = stack.wait_idle(timeout=10)
        assert all(w.num_free_blocks == w.num_blocks for w in stats.workers), stats
    finally:
        gateway.stop()


# ---- faults between the gateway and its upstreams ----------------------------------------------
class OwnTokenizer:
    """A tokenizer process of these tests' own, SIGKILLed and started again on the same port."""

    def __init__(self, log_dir: Path) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log_dir = log_dir
        self.num_starts = 0
        self.service: ServiceProcess | None = None

    def spawn(self) -> None:
        """Start it, without waiting until it serves."""
        self.num_starts += 1
        self.service = ServiceProcess(
            "tokenizer", ["--host", "127.0.0.1", "--port", str(self.port), "--metrics-port", "0",
                          "--log-level", "warning"],
            self.log_dir / f"tokenizer-{self.num_starts}.log")

    def wait_serving(self) -> None:
        self.service.wait_for(lambda: grpc_health(self.address) == "SERVING", "the tokenizer")

    def kill(self) -> None:
        os.kill(self.service.process.pid, signal.SIGKILL)
        self.service.process.wait()
        self.service.log_file.close()


@pytest.fixture(scope="module")
def own_tokenizer(tmp_path_factory):
    tokenizer = OwnTokenizer(tmp_path_factory.mktemp("own-tokenizer"))
    tokenizer.spawn()
    try:
        tokenizer.wait_serving()
        yield tokenizer
    finally:
        tokenizer.service.stop()


@contextlib.contextmanager
def gateway_on(tokenizer_address: str, scheduler_address: str, log_dir: Path, *flags: str):
    """One more gateway process on the given upstreams; yields an HTTP client of its REST API
    (with its process, its gRPC address and its metrics URL)."""
    rest_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    gateway = ServiceProcess("gateway", [
        "--host", "127.0.0.1", "--log-level", "warning", "--port", str(rest_port),
        "--grpc-port", str(grpc_port), "--tokenizer-address", tokenizer_address,
        "--scheduler-address", scheduler_address, "--metrics-port", str(metrics_port), *flags],
        log_dir / "gateway.log")
    rest_url = f"http://127.0.0.1:{rest_port}"
    try:
        gateway.wait_for(lambda: _healthy(rest_url), "the extra gateway", 60)
        with httpx.Client(base_url=rest_url, timeout=60, trust_env=False) as http:
            http.gateway, http.rest_url = gateway, rest_url
            http.grpc_address = f"127.0.0.1:{grpc_port}"
            http.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
            yield http
    finally:
        gateway.stop()


def stream_chat(http: httpx.Client, body: dict, after_chunk) -> tuple[str, dict | None, str | None]:
    """(streamed text, the SSE error event or None, finish reason); `after_chunk(count)` runs
    after each content chunk."""
    texts, error, finish = [], None, None
    with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event
                continue
            choice = event["choices"][0]
            finish = choice.get("finish_reason") or finish
            if choice["delta"].get("content"):
                texts.append(choice["delta"]["content"])
                after_chunk(len(texts))
    return "".join(texts), error, finish


def chat_body(http: httpx.Client, max_tokens: int) -> dict:
    model = http.get("/v1/models").json()["data"][0]["id"]
    return {"model": model, "messages": STORY, "temperature": 0, "max_tokens": max_tokens,
            "ignore_eos": True}


def assert_all_blocks_free(stack: Stack, timeout: float) -> None:
    stats = stack.wait_idle(timeout)
    assert (stats.num_running, stats.num_waiting) == (0, 0), stats
    assert all(w.num_free_blocks == w.num_blocks for w in stats.workers), stats


def test_a_restarted_tokenizer_costs_a_running_stream_nothing(stack, own_tokenizer, tokenizer,
                                                              tmp_path):
    """SIGKILL of the tokenizer right after a stream's first chunk, then a new tokenizer process
    on the same port: the gateway re-sends the sample's detokenizer state, and the stream goes
    on to its last token with no error, its text exactly the decode of all its tokens (nothing
    repeated, nothing skipped)."""
    with gateway_on(own_tokenizer.address, stack.scheduler_address, tmp_path,
                    "--tokenizer-wait-timeout", "120") as http:
        async def stream() -> list:
            chunks = []
            async with KvrelayClient(http.grpc_address) as kv:
                async for chunk in kv.generate(messages=STORY, temperature=0, max_tokens=32,
                                               ignore_eos=True):
                    chunks.append(chunk)
                    if len(chunks) == 1:
                        own_tokenizer.kill()
                        own_tokenizer.spawn()  # serves again some seconds later
            return chunks

        chunks = asyncio.run(asyncio.wait_for(stream(), 180))
        tokens = [token for chunk in chunks for token in chunk.token_ids]
        assert len(tokens) == 32 and chunks[-1].finish_reason == "length"
        assert chunks[0].text  # delivered by the killed tokenizer
        assert "".join(chunk.text for chunk in chunks) == tokenizer.decode(
            tokens, skip_special_tokens=True)
        resumed = metric_value(http.metrics_url,
                               "kvrelay:gateway_detokenize_resumed_samples_total")
        assert resumed == 1  # the new stream took the sample over (it did not finish before)
        own_tokenizer.wait_serving()
        assert_all_blocks_free(stack, 5)
        again = http.post("/v1/chat/completions", json=chat_body(http, 4))  # the next one
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4


def metric_value(url: str, name: str) -> float:
    for line in httpx.get(url, timeout=5, trust_env=False).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    return 0.0


def test_a_tokenizer_that_stays_away_ends_streams_clearly_and_frees_their_blocks(
        stack, own_tokenizer, tmp_path):
    """No tokenizer within --tokenizer-wait-timeout: the stream ends with an error event after
    that wait (not at once), the scheduler is told to abort it (every block free long before
    its 4,000 tokens), and once a tokenizer is back the gateway serves again."""
    with gateway_on(own_tokenizer.address, stack.scheduler_address, tmp_path,
                    "--tokenizer-wait-timeout", "1") as http:
        body = chat_body(http, 4000)
        killed_at = []

        def kill(num_chunks: int) -> None:
            if num_chunks == 3:
                killed_at.append(time.monotonic())  # before: the gateway may notice at once
                own_tokenizer.kill()

        text, error, finish = stream_chat(http, body, kill)
        waited = time.monotonic() - killed_at[0]
        assert error is not None and finish is None, (text, error, finish)
        message = error["error"]["message"]
        assert "tokenizer" in message and "1 s" in message, message
        assert 1.0 <= waited < 10, waited
        assert metric_value(http.metrics_url, "kvrelay:gateway_detokenize_give_ups_total") == 1
        assert_all_blocks_free(stack, 5)
        own_tokenizer.spawn()
        own_tokenizer.wait_serving()
        http.gateway.wait_for(lambda: _healthy(http.rest_url), "the gateway again", 30)
        again = http.post("/v1/chat/completions", json={**body, "max_tokens": 4})
        assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4


def test_aborts_for_a_group_whose_outputs_stream_broke_reach_it_once_back(
        stack, tokenizer_address, tmp_path):
    """A half-open cut between a gateway and its scheduler: the gateway's side of the Outputs
    stream breaks at once, the scheduler's stays open (until its keepalive gives up, after the
    gateway has registered a new stream, so `_abort_gateway` leaves the requests alone). The
    abort the gateway queued for the lost request, while no stream was up, must still reach
    the scheduler: every block is free soon after, not at the end of 4,000 tokens."""
    proxy = TcpProxy(stack.scheduler_address)
    try:
        with gateway_on(tokenizer_address, proxy.address, tmp_path) as http:
            body = chat_body(http, 4000)

            def cut(num_chunks: int) -> None:
                if num_chunks == 3:
                    proxy.cut(half_open=True)

            text, error, finish = stream_chat(http, body, cut)
            assert error is not None and "output stream" in error["error"]["message"], error
            assert_all_blocks_free(stack, 5)
            http.gateway.wait_for(lambda: _healthy(http.rest_url), "the gateway again", 30)
            again = http.post("/v1/chat/completions", json={**body, "max_tokens": 4})
            assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 4
    finally:
        proxy.close()
