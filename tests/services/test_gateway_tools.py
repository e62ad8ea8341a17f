"""Tool calling's text side, without a model: the tool grammar compiles and holds calls to the
schemas, replies parse into OpenAI tool calls, and streamed text splits into content and
tool-call deltas (the name, then the arguments in pieces) however it is chunked."""
from __future__ import annotations

import json

import pytest

from kvrelay.engine.structured.backend import GrammarError
from kvrelay.engine.structured.llguidance_backend import LlguidanceBackend
from kvrelay.engine.model_loader import resolve_model_dir
from kvrelay.gateway.errors import GatewayError
from kvrelay.gateway.openai_protocol import ChatCompletionRequest
from kvrelay.gateway.openai_tools import (ToolCallStream, chat_messages, parse_reply,
                                           tool_choice_mode, tool_grammar, tools_in_play)
from kvrelay.tokenizer.tool_render import HERMES, KVRELAY, template_inputs

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {
    "name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER, ADD], **fields})


@pytest.fixture(scope="module")
def backend():
    tokenizer_json = resolve_model_dir(None) / "tokenizer.json"
    return LlguidanceBackend(tokenizer_json.read_text(), 49152, [2])


def accepts(backend, grammar, text: str) -> bool:
    matcher = backend.compile(grammar).matcher()
    tokens = backend._tokenizer.tokenize_str(text)
    return all(matcher.accept(token) for token in tokens)


def test_modes():
    assert tool_choice_mode(None, None) is None
    assert tool_choice_mode(request().tools, None) == "auto"
    assert tool_choice_mode(request().tools, "none") is None
    named = request(tool_choice={"type": "function", "function": {"name": "add"}})
    assert tool_choice_mode(named.tools, named.tool_choice) == "add"
    with pytest.raises(GatewayError, match="not among the tools"):
        other = request(tool_choice={"type": "function", "function": {"name": "nope"}})
        tool_choice_mode(other.tools, other.tool_choice)
    with pytest.raises(GatewayError, match="needs tools"):
        tool_choice_mode(None, "required")


def test_the_grammars_hold_calls_to_the_schemas(backend):
    tools = request().tools
    call = '<tool_call>{"name":"get_weather","arguments":{"city":"Oslo"}}</tool_call>'
    bad_args = '<tool_call>{"name":"get_weather","arguments":{"town":"Oslo"}}</tool_call>'
    required = tool_grammar(tools, "required", parallel=True)
    assert accepts(backend, required, call + call)
    assert not accepts(backend, required, bad_args)
    assert not accepts(backend, required, "Hello")
    single = tool_grammar(tools, "required", parallel=False)
    assert not accepts(backend, single, call + call)
    named = tool_grammar(tools, "add", parallel=True)
    assert not accepts(backend, named, call)
    assert accepts(backend, named, '<tool_call>{"name":"add","arguments":{"a":1,"b":2}}</tool_call>')
    auto = tool_grammar(tools, "auto", parallel=True)
    assert accepts(backend, auto, "It is sunny.") and accepts(backend, auto, call)
    assert not accepts(backend, auto, bad_args)


def test_a_tool_schema_that_does_not_compile_is_refused(backend):
    broken = {"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}
    with pytest.raises(GrammarError):
        backend.compile(tool_grammar(request(tools=[broken]).tools, "required", True))


def test_parse_reply():
    text = ('Let me check. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    reply = parse_reply(text)
    assert reply.content == "Let me check."
    assert [call["function"]["name"] for call in reply.tool_calls] == ["add", "get_weather"]
    assert json.loads(reply.tool_calls[0]["function"]["arguments"]) == {"a": 1, "b": 2}
    assert all(call["id"].startswith("call_") and call["type"] == "function"
               for call in reply.tool_calls)
    assert len({call["id"] for call in reply.tool_calls}) == 2
    cut = parse_reply('<tool_call>{"name": "add", "argum')  # max_tokens cut it
    assert cut.tool_calls == [] and cut.content.startswith("<tool_call>")
    assert parse_reply("plain").content == "plain"


@pytest.mark.parametrize("chunk_size", [1, 3, 7, 1000])
def test_streamed_calls_equal_the_whole_reply_however_chunked(chunk_size):
    text = ('Sure <b>. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
            '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
    stream, content, deltas = ToolCallStream(), "", []
    for start in range(0, len(text), chunk_size):
        piece, new_deltas = stream.feed(text[start:start + chunk_size])
        content, deltas = content + piece, deltas + new_deltas
    rest, last = stream.finish()
    content, deltas = content + rest, deltas + last
    assert content == "Sure <b>. "
    calls = {}
    for delta in deltas:  # as the openai SDK reassembles them: by index
        entry = calls.setdefault(delta["index"], {"name": "", "arguments": "", "ids": []})
        entry["ids"] += [delta["id"]] if "id" in delta else []
        entry["name"] += delta["function"].get("name", "")
        entry["arguments"] += delta["function"]["arguments"]
    assert sorted(calls) == [0, 1] and stream.num_calls == 2
    assert all(len(call["ids"]) == 1 for call in calls.values())  # the id once, with the name
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [("add", {"a": 1, "b": 2}), ("get_weather", {"city": "Rome"})]


def test_rendering_lists_tools_and_replays_calls_and_results():
    """The gateway's conversation, rendered in kvrelay's default format (tool_render.py)."""
    body = ChatCompletionRequest.model_validate({"tools": [WEATHER], "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp_c": 3}'}]})
    conversation = chat_messages(body.messages)
    assert conversation[2]["tool_calls"] == [{"name": "get_weather",
                                              "arguments": {"city": "Oslo"}}]
    assert conversation[3]["tool_call_id"] == "call_1"
    messages, tools = template_inputs(conversation, tools_in_play(body.tools, "auto"), KVRELAY)
    assert tools is None  # listed in the system message instead
    assert messages[0]["role"] == "system" and messages[0]["content"].startswith("Be brief.")
    assert '"name": "get_weather"' in messages[0]["content"] and "<tools>" in messages[0]["content"]
    assert messages[2]["content"] == \
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    assert messages[3] == {"role": "tool", "content": '{"temp_c": 3}'}
    assert tools_in_play(body.tools, None) is None  # tool_choice none: no listing
    plain, _ = template_inputs(conversation, None, KVRELAY)
    assert "<tools>" not in plain[0]["content"]


@pytest.mark.parametrize("arguments", ['{"city": ', '["Oslo"]', '"Oslo"'])
def test_call_arguments_that_are_not_a_json_object_are_a_400(arguments):
    body = ChatCompletionRequest.model_validate({"messages": [
        {"role": "assistant", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": arguments}}]}]})
    with pytest.raises(GatewayError, match="not a JSON object"):
        chat_messages(body.messages)


def test_the_hermes_grammar_puts_calls_and_their_json_on_lines_of_their_own(backend):
    tools = request().tools
    one = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Oslo"}}\n</tool_call>'
    two = one + '\n<tool_call>\n{"name":"add","arguments":{"a":1,"b":2}}\n</tool_call>'
    required = tool_grammar(tools, "required", True, HERMES)
    assert accepts(backend, required, one) and accepts(backend, required, two)
    assert not accepts(backend, required, one.replace("\n", ""))  # kvrelay's own form
    assert not accepts(backend, tool_grammar(tools, "required", False, HERMES), two)
    assert accepts(backend, tool_grammar(tools, "auto", True, HERMES), "It is sunny.")
    assert parse_reply(two).tool_calls[1]["function"]["name"] == "add"
