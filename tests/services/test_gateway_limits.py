"""The gateway's request limits (services/gateway/limits.py), each set small on a real gateway
process next to a real tokenizer and no scheduler: a request over a limit gets a 400 (413 for
the body) naming the field on REST and INVALID_ARGUMENT (RESOURCE_EXHAUSTED) on the public gRPC
API; one just under it gets as far as the missing scheduler (503 / UNAVAILABLE)."""
from __future__ import annotations

import os
import threading
import time
from unittest import mock

import grpc
import httpx
import pytest

from kvrelay.api.kvrelay.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from kvrelay.gateway.limits import LIMITS, RequestLimits
from kvrelay.gateway.proto_text_fields import proto_texts, undecodable_string_field
from kvrelay.gateway.text_fields import json_texts
from tests.services.conftest import ServiceProcess, free_port, grpc_health
from tests.services.test_gateway_service import assert_openai_error

SMALL = {"--max-request-body-bytes": 65536, "--max-request-text-chars": 4000,
         "--max-prompt-tokens": 64, "--max-prompts": 2, "--max-n": 2, "--max-messages": 3,
         "--max-stop-strings": 2, "--max-stop-string-chars": 8, "--max-logprobs": 3}
CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
COMPLETION = {"prompt": "Hi", "max_tokens": 4}


def start_gateway(tokenizer_address: str, log_path, flags: dict, env: dict | None = None):
    port, grpc_port = free_port(), free_port()
    args = ["--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(grpc_port),
            "--tokenizer-address", tokenizer_address,
            "--scheduler-address", f"127.0.0.1:{free_port()}", "--served-model-name", "smol",
            "--log-level", "warning", "--metrics-port", "0"]
    for flag, value in flags.items():
        args += [flag, str(value)]
    with mock.patch.dict(os.environ, env or {}):
        service = ServiceProcess("gateway", args, log_path)
    service.wait_for(lambda: grpc_health(f"127.0.0.1:{grpc_port}") != "UNREACHABLE", "gateway")
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10, trust_env=False)
    service.wait_for(lambda: _answers(http), "gateway REST")
    http.grpc_address = f"127.0.0.1:{grpc_port}"
    return service, http


def _answers(http: httpx.Client) -> bool:
    try:
        return http.get("/version").status_code == 200
    except httpx.TransportError:
        return False


@pytest.fixture(scope="module")
def gateway(tokenizer_address, tmp_path_factory):
    flags = {**SMALL, "--submit-wait-timeout": 0}  # valid requests get their 503 at once
    service, http = start_gateway(tokenizer_address,
                                  tmp_path_factory.mktemp("limits") / "gateway.log", flags)
    try:
        yield http
    finally:
        http.close()
        service.stop()


@pytest.fixture(scope="module")
def stub(gateway):
    with grpc.insecure_channel(gateway.grpc_address) as channel:
        yield generation_pb2_grpc.GenerationStub(channel)


def refused(response: httpx.Response, param: str | None, status: int = 400) -> str:
    error = assert_openai_error(response, status)
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    return error["message"]


def passes(response: httpx.Response) -> None:
    assert "scheduler" in assert_openai_error(response, 503)["message"]


# ---- REST ----------------------------------------------------------------------------------------
def test_a_body_over_the_size_limit_is_413_by_its_content_length(gateway):
    body = {**CHAT, "messages": [{"role": "user", "content": "x" * 70_000}]}
    response = gateway.post("/v1/chat/completions", json=body)
    assert "65536 bytes" in refused(response, None, 413)
    assert response.headers["connection"] == "close"
    passes(gateway.post("/v1/chat/completions", json=CHAT))  # a new connection serves


def test_a_chunked_body_over_the_size_limit_is_413_once_it_passes_it(gateway):
    def chunks():  # no Content-Length: Transfer-Encoding chunked
        yield b'{"prompt": "'
        for _ in range(40):
            yield b"y" * 4096
        yield b'"}'

    response = gateway.post("/v1/completions", content=chunks(),
                            headers={"content-type": "application/json"})
    refused(response, None, 413)


def test_prompt_tokens_over_the_limit(gateway):
    refused(gateway.post("/v1/completions", json={**COMPLETION, "prompt": list(range(65))}),
            "prompt")
    passes(gateway.post("/v1/completions", json={**COMPLETION, "prompt": list(range(64))}))
    long_chat = {**CHAT, "messages": [{"role": "user", "content": "word " * 80}]}
    assert "tokens" in refused(gateway.post("/v1/chat/completions", json=long_chat),
                               "messages")


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {**CHAT, "n": 3}, "n"),
    ("/v1/completions", {**COMPLETION, "n": 3}, "n"),
    ("/v1/chat/completions", {**CHAT, "stop": ["a", "b", "c"]}, "stop"),
    ("/v1/completions", {**COMPLETION, "stop": "123456789"}, "stop"),
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 4}, "top_logprobs"),
    ("/v1/completions", {**COMPLETION, "logprobs": 4}, "logprobs"),
    ("/v1/chat/completions", {**CHAT, "messages": CHAT["messages"] * 4}, "messages"),
    ("/tokenize", {"messages": CHAT["messages"] * 4}, "messages"),
    ("/v1/completions", {**COMPLETION, "prompt": ["a", "b", "c"]}, "prompt"),
], ids=["n chat", "n completions", "stop count", "stop length", "top_logprobs", "logprobs",
        "messages", "tokenize messages", "prompts"])
def test_each_count_limit_is_a_400_naming_its_field(gateway, path, body, param):
    refused(gateway.post(path, json=body), param)


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**CHAT, "n": 2, "stop": ["a", "12345678"], "logprobs": True,
                              "top_logprobs": 3, "messages": CHAT["messages"] * 3}),
    ("/v1/completions", {**COMPLETION, "prompt": ["a", "b"], "logprobs": 3}),
], ids=["chat", "completions"])
def test_requests_at_each_limit_pass(gateway, path, body):
    passes(gateway.post(path, json=body))


def test_total_text_over_the_limit(gateway):
    messages = [{"role": "user", "content": "z" * 1500}] * 3  # 4,500 characters in all
    assert "4000" in refused(gateway.post("/v1/chat/completions",
                                          json={**CHAT, "messages": messages}), None)
    assert "4000" in refused(gateway.post("/tokenize", json={"prompt": "z" * 4001}), None)


@pytest.mark.parametrize("raw, where", [
    (b'{"messages": [{"role": "user", "content": "a\xffb"}], "max_tokens": 4}',
     "messages.0.content"),
    (b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}', "messages.0.content"),
    (b'{"prompt": ["ok", "\xc3\x28"]}', "prompt.1"),
    (b'{"prompt": "Hi", "stop": ["\xe2\x82"]}', "stop.0"),
], ids=["bad byte", "lone surrogate escape", "truncated sequence", "in a stop string"])
def test_invalid_utf8_is_a_400_naming_the_field(gateway, raw, where):
    path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
    response = gateway.post(path, content=raw, headers={"content-type": "application/json"})
    assert refused(response, where.split(".")[0]) == f"{where} is not valid UTF-8"


@pytest.mark.parametrize("text", ["a\x00b", "\x1b[31mred", "del\x7f", "c1\x85", "\x10"])
def test_control_characters_are_text(gateway, text):
    body = {**CHAT, "messages": [{"role": "system", "content": "ok"},
                                 {"role": "user", "content": text}]}
    passes(gateway.post("/v1/chat/completions", json=body))
    passes(gateway.post("/v1/completions", json={**COMPLETION, "stop": [text]}))


def test_raw_control_characters_in_json(gateway):
    """A raw C0 byte in a string is not JSON (a 400 for the body); raw C1 in UTF-8 and DEL are."""
    def post(raw: bytes):
        body = b'{"messages": [{"role": "user", "content": "' + raw + b'"}], "max_tokens": 4}'
        return gateway.post("/v1/chat/completions", content=body,
                            headers={"content-type": "application/json"})
    response = post(b"a\x01b")
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"
    passes(post(b"c1 \xc2\x85"))
    passes(post(b"del \x7f"))


def test_tab_newline_and_carriage_return_are_text(gateway):
    body = {**CHAT, "messages": [{"role": "user", "content": "a\tb\nc\r\nd"}]}
    passes(gateway.post("/v1/chat/completions", json=body))
    raw = b'{"messages": [{"role": "user", "content": "a\\u0009b\\u000a\xc3\xa9"}]}'
    passes(gateway.post("/v1/chat/completions", content=raw,
                        headers={"content-type": "application/json"}))


# ---- the public gRPC API -------------------------------------------------------------------------
def grpc_code(call, *args) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as info:
        result = call(*args, timeout=10)
        if not isinstance(result, (generation_pb2.TokenizeResponse,
                                   generation_pb2.AbortResponse)):
            list(result)
    return info.value.code(), info.value.details()


def generate(**fields) -> generation_pb2.GenerateRequest:
    params = fields.pop("params", common_pb2.SamplingParams(max_tokens=4))
    return generation_pb2.GenerateRequest(params=params, **fields)


@pytest.mark.parametrize("request_, field", [
    (generate(prompt="Hi", params=common_pb2.SamplingParams(n=3)), "params.n"),
    (generate(prompt="Hi", params=common_pb2.SamplingParams(stop=["a", "b", "c"])),
     "params.stop"),
    (generate(prompt="Hi", params=common_pb2.SamplingParams(stop=["123456789"])),
     "params.stop"),
    (generate(prompt="Hi", params=common_pb2.SamplingParams(logprobs=4)), "params.logprobs"),
    (generate(chat=generation_pb2.ChatMessages(messages=[
        common_pb2.ChatMessage(role="user", content="Hi")] * 4)), "chat.messages"),
    (generate(prompt_token_ids=generation_pb2.TokenIds(ids=list(range(65)))), "65 tokens"),
    (generate(prompt="word " * 80), "tokens"),
    (generate(prompt="z" * 4001), "4000"),
], ids=["n", "stop count", "stop length", "logprobs", "messages", "prompt token ids",
        "prompt tokens", "text"])
def test_grpc_generate_applies_the_same_limits(stub, request_, field):
    code, details = grpc_code(stub.Generate, request_)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and field in details, (code, details)


def test_grpc_requests_at_the_limits_pass(stub):
    request = generate(prompt_token_ids=generation_pb2.TokenIds(ids=list(range(64))),
                       params=common_pb2.SamplingParams(n=2, stop=["a", "12345678"],
                                                        logprobs=3))
    assert grpc_code(stub.Generate, request)[0] == grpc.StatusCode.UNAVAILABLE


def test_grpc_tokenize_applies_the_text_limits(stub):
    code, details = grpc_code(stub.Tokenize, generation_pb2.TokenizeRequest(prompt="z" * 4001))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "4000" in details
    chat = generation_pb2.ChatMessages(messages=[common_pb2.ChatMessage(role="u")] * 4)
    code, details = grpc_code(stub.Tokenize, generation_pb2.TokenizeRequest(chat=chat))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "chat.messages" in details


def raw_call(gateway, method: str, payload: bytes) -> tuple[grpc.StatusCode, str]:
    """A call whose request bytes are given as they are (no client-side serialization)."""
    with grpc.insecure_channel(gateway.grpc_address) as channel:
        call = channel.unary_stream(f"/kvrelay.v1.Generation/{method}")
        with pytest.raises(grpc.RpcError) as info:
            list(call(payload, timeout=10))
    return info.value.code(), info.value.details()


def test_grpc_invalid_utf8_is_invalid_argument_naming_the_field(gateway):
    # Regression: a message protobuf cannot parse was UNKNOWN ("Unexpected DecodeError").
    chat = generation_pb2.ChatMessages(messages=[
        common_pb2.ChatMessage(role="user", content="ok"),
        common_pb2.ChatMessage(role="user", content="a?b")])
    payload = generation_pb2.GenerateRequest(chat=chat).SerializeToString()
    payload = payload.replace(b"a?b", b"a\xffb")
    assert raw_call(gateway, "Generate", payload) == (
        grpc.StatusCode.INVALID_ARGUMENT, "chat.messages.1.content is not valid UTF-8")
    stop = generation_pb2.GenerateRequest(prompt="Hi", params=common_pb2.SamplingParams(
        stop=["x", "??"])).SerializeToString().replace(b"??", b"\xed\xa0")
    assert raw_call(gateway, "Generate", stop)[1] == "params.stop.1 is not valid UTF-8"


def test_grpc_garbage_and_oversized_messages(gateway):
    code, details = raw_call(gateway, "Generate", b"\xff\xff\xff\xff")
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "does not parse" in details
    big = generation_pb2.GenerateRequest(prompt="x" * 70_000).SerializeToString()
    code, details = raw_call(gateway, "Generate", big)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "65536 bytes" in details
    with grpc.insecure_channel(gateway.grpc_address) as channel:
        tokenize = channel.unary_unary("/kvrelay.v1.Generation/Tokenize")
        with pytest.raises(grpc.RpcError) as info:
            tokenize(b"\x12\x02\xc3\x28", timeout=10)  # prompt = invalid UTF-8
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "prompt is not valid UTF-8"


def test_grpc_concurrent_streams_per_connection(tokenizer_address, tmp_path):
    """The flag, here through its KVRELAY_* variable: with 1, a second call on the same
    connection waits for the first (each waits 1 s for a scheduler that never comes)."""
    service, http = start_gateway(tokenizer_address, tmp_path / "gateway.log",
                                  {"--submit-wait-timeout": 1},
                                  env={"KVRELAY_GRPC_MAX_CONCURRENT_STREAMS": "1"})
    try:
        with grpc.insecure_channel(http.grpc_address) as channel:
            stub = generation_pb2_grpc.GenerationStub(channel)
            stub.Tokenize(generation_pb2.TokenizeRequest(prompt="warm"), timeout=10)  # connect
            elapsed = _run_together(lambda: grpc_code(stub.Generate, generate(prompt="Hi")), 2)
        assert elapsed >= 1.9, elapsed  # one after the other
    finally:
        http.close()
        service.stop()


def _run_together(call, count: int) -> float:
    results = []
    threads = [threading.Thread(target=lambda: results.append(call())) for _ in range(count)]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    assert [code for code, _ in results] == [grpc.StatusCode.UNAVAILABLE] * count, results
    return time.monotonic() - started


# ---- the pieces, in process ----------------------------------------------------------------------
def test_every_limit_is_a_flag_with_a_positive_default():
    defaults = RequestLimits()
    for name, limit in LIMITS.items():
        assert limit.flag == "--" + name.replace("_", "-") and limit.help
        assert getattr(defaults, name) == limit.default
        assert limit.default > 0 or name == "max_prompt_tokens"  # 0: the model's context
    with pytest.raises(SystemExit, match="--max-logprobs"):
        RequestLimits(max_logprobs=21)
    with pytest.raises(SystemExit, match="--max-n"):
        RequestLimits(max_n=0)


def test_text_field_paths():
    from kvrelay.gateway.openai_protocol import ChatCompletionRequest
    body = ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "t"}]}],
         "stop": ["s"], "guided_json": {"k": ["v"]}})
    texts = dict(json_texts(body))
    assert texts["messages.0.role"] == "user" and texts["messages.0.content.0.text"] == "t"
    assert texts["stop.0"] == "s" and texts["guided_json.k.0"] == "v"
    request = generate(chat=generation_pb2.ChatMessages(messages=[
        common_pb2.ChatMessage(role="r", content="c")]), params=common_pb2.SamplingParams(
        stop=["s"], structured_outputs=common_pb2.StructuredOutputs(regex="x+")))
    assert dict(proto_texts(request)) == {
        "chat.messages.0.role": "r", "chat.messages.0.content": "c", "params.stop.0": "s",
        "params.structured_outputs.regex": "x+"}
    assert undecodable_string_field(generation_pb2.GenerateRequest.DESCRIPTOR,
                                    b"\xff\xff") is None  # not protobuf: no field to name
