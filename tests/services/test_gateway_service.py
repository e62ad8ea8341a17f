"""A real gateway process next to a real tokenizer, with no scheduler: validation answers 400
with OpenAI error bodies, auth answers 401, health says 503 / NOT_SERVING, a valid request gets
a quick 503 rather than a hang, and the tokenizer endpoints work."""
from __future__ import annotations

import json

import grpc
import httpx
import pytest

from tests.services.conftest import ServiceProcess, free_port, grpc_health
from kvrelay.api.kvrelay.v1 import common_pb2, generation_pb2, generation_pb2_grpc

API_KEY = "test-key"
MODEL = "smol-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
GOOD_CHAT = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}

BAD_CHAT_BODIES = {
    "malformed json": b'{"messages": [{"role": "user", "content": "Hi"}',
    "not an object": b"[1, 2]",
    "empty body": b"",
    "messages not a list": {"messages": "Hi"},
    "empty messages": {"messages": []},
    "message without role": {"messages": [{"content": "Hi"}]},
    "image content": {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]},
    "max_tokens a string": {**GOOD_CHAT, "max_tokens": "ten"},
    "max_tokens 0": {**GOOD_CHAT, "max_tokens": 0},
    "max_tokens above uint32": {**GOOD_CHAT, "max_tokens": 2**40},
    "temperature -1": {**GOOD_CHAT, "temperature": -1},
    "temperature a list": {**GOOD_CHAT, "temperature": [1]},
    "top_p 2": {**GOOD_CHAT, "top_p": 2},
    "top_k -5": {**GOOD_CHAT, "top_k": -5},
    "n 0": {**GOOD_CHAT, "n": 0},
    "n fractional": {**GOOD_CHAT, "n": 1.5},
    "seed too big": {**GOOD_CHAT, "seed": 2**70},
    "stop empty string": {**GOOD_CHAT, "stop": [""]},
    "stop_token_ids negative": {**GOOD_CHAT, "stop_token_ids": [-1]},
    "min_tokens above max_tokens": {**GOOD_CHAT, "min_tokens": 9},
    "presence_penalty 3": {**GOOD_CHAT, "presence_penalty": 3},
    "repetition_penalty 0": {**GOOD_CHAT, "repetition_penalty": 0},
    "top_logprobs without logprobs": {**GOOD_CHAT, "top_logprobs": 2},
    "top_logprobs 21": {**GOOD_CHAT, "logprobs": True, "top_logprobs": 21},
    "stream_options without stream": {**GOOD_CHAT, "stream_options": {"include_usage": True}},
}
BAD_COMPLETION_BODIES = {
    "prompt a number": {"prompt": 42},
    "prompt missing": {"max_tokens": 3},
    "prompt empty list": {"prompt": []},
    "prompt empty string": {"prompt": ""},
    "prompt mixed list": {"prompt": ["a", 1]},
    "negative token id": {"prompt": [1, -2]},
    "negative max_tokens": {"prompt": "Hi", "max_tokens": -1},
    "logprobs too many": {"prompt": "Hi", "logprobs": 1000},
    "prompt_logprobs too many": {"prompt": "Hi", "prompt_logprobs": 21},
    "prompt_logprobs negative": {"prompt": "Hi", "prompt_logprobs": -1},
    "suffix": {"prompt": "Hi", "suffix": "end"},
}


@pytest.fixture(scope="module")
def gateway(tokenizer_address, tmp_path_factory):
    port, grpc_port, metrics_port = free_port(), free_port(), free_port()
    dead_scheduler = f"127.0.0.1:{free_port()}"
    service = ServiceProcess("gateway", [
        "--host", "127.0.0.1", "--port", str(port), "--grpc-port", str(grpc_port),
        "--metrics-port", str(metrics_port),
        "--tokenizer-address", tokenizer_address, "--scheduler-address", dead_scheduler,
        "--served-model-name", MODEL, "--api-key", API_KEY, "--log-level", "warning",
        "--submit-wait-timeout", "0"],  # no scheduler will come: valid requests get 503 at once
        tmp_path_factory.mktemp("gateway") / "gateway.log")
    try:
        service.wait_for(lambda: grpc_health(f"127.0.0.1:{grpc_port}") != "UNREACHABLE",
                         "gateway")
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=AUTH, timeout=10,
                          trust_env=False) as http:
            service.wait_for(lambda: _answers(http), "gateway REST")
            http.grpc_address = f"127.0.0.1:{grpc_port}"
            http.metrics_base = f"http://127.0.0.1:{metrics_port}"
            yield http
    finally:
        service.stop()


def _answers(http: httpx.Client) -> bool:
    try:
        return http.get("/version").status_code == 200
    except httpx.TransportError:
        return False


def post(http: httpx.Client, path: str, body, **kwargs) -> httpx.Response:
    if isinstance(body, bytes):
        return http.post(path, content=body, headers={"content-type": "application/json"},
                         **kwargs)
    return http.post(path, json=body, **kwargs)


def assert_openai_error(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    return error


def test_unknown_model_is_404_model_not_found(gateway):
    error = assert_openai_error(post(gateway, "/v1/chat/completions",
                                     {**GOOD_CHAT, "model": "no-such-model"}), 404)
    assert error["code"] == "model_not_found" and error["param"] == "model"


@pytest.mark.parametrize("case", list(BAD_CHAT_BODIES))
def test_bad_chat_request_is_400(gateway, case):
    error = assert_openai_error(post(gateway, "/v1/chat/completions", BAD_CHAT_BODIES[case]))
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize("case", list(BAD_COMPLETION_BODIES))
def test_bad_completion_request_is_400(gateway, case):
    assert_openai_error(post(gateway, "/v1/completions", BAD_COMPLETION_BODIES[case]))


def test_error_names_the_parameter_and_returns_the_request_id(gateway):
    response = post(gateway, "/v1/chat/completions", {**GOOD_CHAT, "top_p": 2, "stream": True},
                    headers={"X-Request-Id": "my-id-1"})
    error = assert_openai_error(response)  # JSON, not an event stream
    assert error["param"] == "top_p" and "top_p" in error["message"]
    assert response.headers["x-request-id"] == "my-id-1"


def test_unknown_fields_are_refused_by_name(gateway):
    error = assert_openai_error(post(gateway, "/v1/chat/completions",
                                     {**GOOD_CHAT, "frobnicate": True}))
    assert error["param"] == "frobnicate" and "frobnicate is not supported" in error["message"]
    body = {**GOOD_CHAT, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}], "extra": 1}]}
    error = assert_openai_error(post(gateway, "/v1/chat/completions", body))
    assert "messages.0.extra" in error["message"]


def test_valid_requests_fail_fast_without_a_scheduler(gateway):
    for path, body in (("/v1/chat/completions", {**GOOD_CHAT, "stream": True}),
                       ("/v1/completions", {"prompt": ["a", "b"], "n": 2})):
        error = assert_openai_error(post(gateway, path, body), 503)
        assert "scheduler" in error["message"]


def test_api_key_is_required_on_every_route_but_health(gateway):
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer wrong"}):
        response = gateway.post("/v1/chat/completions", json=GOOD_CHAT, headers=headers)
        assert assert_openai_error(response, 401)["type"] == "authentication_error"
        assert gateway.get("/v1/models", headers=headers).status_code == 401
    bare = {"Authorization": ""}
    assert gateway.get("/health", headers=bare).status_code == 503  # no scheduler: not ready
    assert gateway.get("/version", headers=bare).status_code == 401
    assert gateway.get("/openapi.json", headers=bare).status_code == 401
    assert gateway.get("/openapi.json").json()["paths"]["/v1/chat/completions"]
    assert gateway.get("/metrics", headers=bare).status_code == 404  # not on the public port
    metrics = httpx.get(f"{gateway.metrics_base}/metrics", timeout=10, trust_env=False)
    assert "kvrelay:time_to_first_token_seconds_bucket" in metrics.text
    assert "kvrelay:request_success_total" in metrics.text
    health = httpx.get(f"{gateway.metrics_base}/health", timeout=10, trust_env=False)
    assert health.status_code == 503  # the same readiness as the public /health


def test_models_tokenize_detokenize(gateway, tokenizer):
    models = gateway.get("/v1/models").json()
    assert [model["id"] for model in models["data"]] == [MODEL]
    text = "Hello 世界 🚀"
    tokens = post(gateway, "/tokenize", {"prompt": text}).json()
    assert tokens["tokens"] == tokenizer.encode(text) and tokens["count"] == len(tokens["tokens"])
    chat = post(gateway, "/tokenize", {"messages": GOOD_CHAT["messages"]}).json()
    expected = tokenizer.apply_chat_template(GOOD_CHAT["messages"], add_generation_prompt=True)
    assert chat["tokens"] == list(expected["input_ids"] if hasattr(expected, "keys")
                                  else expected)
    assert post(gateway, "/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": text}
    assert_openai_error(post(gateway, "/detokenize", {"tokens": [10**8]}))
    assert_openai_error(post(gateway, "/tokenize", {}))
    assert_openai_error(gateway.get("/v1/nothing-here"), 404)


def test_grpc_api_errors_and_tokenize(gateway, tokenizer):
    assert grpc_health(gateway.grpc_address) == "NOT_SERVING"
    metadata = (("authorization", f"Bearer {API_KEY}"),)
    with grpc.insecure_channel(gateway.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        bad = generation_pb2.GenerateRequest(prompt="Hi", params=common_pb2.SamplingParams(
            temperature=-1))
        for call_metadata, code in ((metadata, grpc.StatusCode.INVALID_ARGUMENT),
                                    ((), grpc.StatusCode.UNAUTHENTICATED)):
            with pytest.raises(grpc.RpcError) as info:
                list(stub.Generate(bad, metadata=call_metadata, timeout=10))
            assert info.value.code() == code and info.value.details()
        good = generation_pb2.GenerateRequest(prompt="Hi")
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(good, metadata=metadata, timeout=10))
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        reply = stub.Tokenize(generation_pb2.TokenizeRequest(prompt="Hi there"),
                              metadata=metadata, timeout=10)
        assert list(reply.token_ids) == tokenizer.encode("Hi there")
        models = stub.ListModels(generation_pb2.ListModelsRequest(), metadata=metadata)
        assert [model.id for model in models.models] == [MODEL]


TOOL_TURNS = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 3}'}]


def test_tool_calls_in_the_conversation_are_rendered_not_dropped(gateway, tokenizer):
    """REST /tokenize and the gRPC Tokenize both render an earlier call (kvrelay's format on the
    default model's template, services/tokenizer/tool_render.py); a call whose arguments are not
    a JSON object is refused on both."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    expected = tokenizer.apply_chat_template(
        [TOOL_TURNS[0], {"role": "assistant", "content": call},
         {"role": "tool", "content": TOOL_TURNS[2]["content"]}], add_generation_prompt=True)
    expected = list(expected["input_ids"] if hasattr(expected, "keys") else expected)
    assert post(gateway, "/tokenize", {"messages": TOOL_TURNS}).json()["tokens"] == expected
    bad = [TOOL_TURNS[0], {**TOOL_TURNS[1], "tool_calls": [
        {**TOOL_TURNS[1]["tool_calls"][0], "function": {"name": "f", "arguments": "[1]"}}]}]
    assert assert_openai_error(post(gateway, "/tokenize", {"messages": bad}))["param"] == \
        "messages"
    metadata = (("authorization", f"Bearer {API_KEY}"),)
    messages = [common_pb2.ChatMessage(role="user", content="Weather in Oslo?"),
                common_pb2.ChatMessage(role="assistant", content="", tool_calls_json=json.dumps(
                    [{"name": "get_weather", "arguments": {"city": "Oslo"}}])),
                common_pb2.ChatMessage(role="tool", content='{"temp_c": 3}',
                                       tool_call_id="call_1")]
    with grpc.insecure_channel(gateway.grpc_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        reply = stub.Tokenize(generation_pb2.TokenizeRequest(
            chat=generation_pb2.ChatMessages(messages=messages, add_generation_prompt=True)),
            metadata=metadata, timeout=10)
        assert list(reply.token_ids) == expected
        messages[1].tool_calls_json = '[{"name": "get_weather"}]'
        with pytest.raises(grpc.RpcError) as info:
            stub.Tokenize(generation_pb2.TokenizeRequest(
                chat=generation_pb2.ChatMessages(messages=messages)), metadata=metadata,
                timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "tool_calls_json" in info.value.details()
