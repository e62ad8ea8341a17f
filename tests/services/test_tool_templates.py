"""Tool calling through the tokenizer service's chat templates, over real gRPC: the default
model's template (no tool support) gets kvrelay's default format; a template with Hermes-style
tool support (`--chat-template`, tests/data/hermes_tools_template.jinja) renders the tools, the
earlier calls and the results itself, and the service says which format the model was taught."""
from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from kvrelay.api.kvrelay.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from kvrelay.tokenizer.tool_render import (HERMES, KVRELAY, parse_tool_calls, template_inputs,
                                            tool_call_format)
from tests.services.conftest import ServiceProcess, free_port, grpc_health

TEMPLATE = Path(__file__).resolve().parents[1] / "data" / "hermes_tools_template.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "", "tool_calls": [{"name": "get_weather",
                                                         "arguments": {"city": "Oslo"}}]},
    {"role": "tool", "content": '{"temp_c": 3}', "tool_call_id": "call_1", "name": "get_weather"}]


@pytest.fixture(scope="module")
def hermes_stub(tmp_path_factory):
    port = free_port()
    address = f"127.0.0.1:{port}"
    service = ServiceProcess("tokenizer", ["--host", "127.0.0.1", "--port", str(port),
                                           "--metrics-port", "0", "--log-level", "warning",
                                           "--chat-template", str(TEMPLATE)],
                             tmp_path_factory.mktemp("hermes-tokenizer") / "tokenizer.log")
    try:
        service.wait_for(lambda: grpc_health(address) == "SERVING", "tokenizer service")
        with grpc.insecure_channel(address) as channel:
            yield tokenizer_pb2_grpc.TokenizerStub(channel)
    finally:
        service.stop()


@pytest.fixture(scope="module")
def default_stub(tokenizer_address):
    with grpc.insecure_channel(tokenizer_address) as channel:
        yield tokenizer_pb2_grpc.TokenizerStub(channel)


def _encode(stub, messages, tools=None):
    chat = tokenizer_pb2.ChatRender(
        messages=[common_pb2.ChatMessage(
            role=m["role"], content=m["content"],
            tool_calls_json=json.dumps(m["tool_calls"]) if m.get("tool_calls") else "",
            tool_call_id=m.get("tool_call_id", ""), name=m.get("name", "")) for m in messages],
        add_generation_prompt=True, tools_json=json.dumps(tools) if tools else "")
    return stub.Encode(tokenizer_pb2.EncodeRequest(chat=chat))


def _ids(rendered):
    return list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)


def test_the_format_follows_what_the_template_renders(tokenizer):
    assert tool_call_format(tokenizer.chat_template) == KVRELAY  # SmolLM2's: no tools
    assert tool_call_format(TEMPLATE.read_text()) == HERMES
    # reads `tools` but writes calls some other way: kvrelay's format, whose calls it can parse
    assert tool_call_format("{% for tool in tools %}{{ tool }}{% endfor %}[CALLS]") == KVRELAY
    assert tool_call_format("<tool_call>{{ toolset }}") == KVRELAY


def test_a_template_with_tool_support_renders_the_tools_calls_and_results(hermes_stub, tokenizer):
    reply = _encode(hermes_stub, CONVERSATION, [WEATHER])
    assert reply.tool_call_format == HERMES
    messages, tools = template_inputs(CONVERSATION, [WEATHER], HERMES)
    expected = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                             chat_template=TEMPLATE.read_text(), tokenize=True)
    assert list(reply.token_ids) == _ids(expected)
    text = tokenizer.decode(list(reply.token_ids))
    assert json.dumps(WEATHER) in text  # the template's own listing, not kvrelay's
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>' \
        in text
    assert '<tool_response>\n{"temp_c": 3}\n</tool_response>' in text
    assert "# Tools\nYou can call functions" not in text


def test_the_default_template_gets_kvrelays_format(default_stub, tokenizer):
    reply = _encode(default_stub, CONVERSATION, [WEATHER])
    assert reply.tool_call_format == KVRELAY
    messages, _ = template_inputs(CONVERSATION, [WEATHER], KVRELAY)
    assert list(reply.token_ids) == _ids(tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True))
    text = tokenizer.decode(list(reply.token_ids))
    assert "<tools>" in text and \
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text


def test_a_prompt_is_not_a_chat_and_has_no_tool_format(hermes_stub):
    reply = hermes_stub.Encode(tokenizer_pb2.EncodeRequest(prompt="Hi", add_special_tokens=True))
    assert reply.token_ids and reply.tool_call_format == ""


@pytest.mark.parametrize("field, value", [
    ("tool_calls_json", "{not json"), ("tool_calls_json", '[{"name": "f", "arguments": "x"}]'),
    ("tool_calls_json", '{"name": "f", "arguments": {}}'), ("tools_json", '{"type": "function"}'),
    ("tools_json", "[1, 2]")])
def test_malformed_tool_json_is_invalid_argument(hermes_stub, field, value):
    message = common_pb2.ChatMessage(role="assistant", content="")
    chat = tokenizer_pb2.ChatRender(messages=[common_pb2.ChatMessage(role="user", content="Hi")])
    if field == "tool_calls_json":
        message.tool_calls_json = value
        chat.messages.append(message)
    else:
        chat.tools_json = value
    with pytest.raises(grpc.RpcError) as error:
        hermes_stub.Encode(tokenizer_pb2.EncodeRequest(chat=chat))
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "json" in error.value.details().lower()


def test_parse_tool_calls_takes_the_gateways_form_only():
    assert parse_tool_calls('[{"name": "f", "arguments": {"a": 1}}]') == \
        [{"name": "f", "arguments": {"a": 1}}]
    with pytest.raises(ValueError, match="must be a list"):
        parse_tool_calls('[{"name": "f"}]')
