"""Qwen3-Coder's XML tool calls, without a model: the grammar holds each parameter to its schema
(a string as raw text, an enum to its values, anything else as JSON) and the format; the
streamed reading gives the name first, then the arguments as JSON text a parameter at a time,
the same however the text is chunked; whole replies parse into OpenAI tool calls."""
from __future__ import annotations

import json
import random

import pytest

from kvrelay.gateway.openai_protocol import ChatCompletionRequest
from kvrelay.gateway.openai_tools import call_events, parse_reply, tool_grammar
from kvrelay.tokenizer.tool_render import QWEN3_CODER, tool_call_format
from tests.services.tool_events import llguidance_backend, summary, takes

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"},
                                     "unit": {"enum": ["celsius", "fahrenheit"]},
                                     "days": {"type": "integer", "minimum": 1, "maximum": 7}},
    "required": ["city", "unit"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}}
TOOLS = ChatCompletionRequest.model_validate(
    {"messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER, ADD]}).tools

WEATHER_CALL = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew </York>\n"
                "</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n<parameter=days>\n3\n"
                "</parameter>\n</function>\n</tool_call>")
ADD_CALL = ("<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>\n-2\n"
            "</parameter>\n</function>\n</tool_call>")
REPLY = WEATHER_CALL + "\n" + ADD_CALL
EXPECTED = [("get_weather", {"city": "New </York>", "unit": "celsius", "days": 3}),
            ("add", {"a": 1, "b": -2})]



@pytest.mark.parametrize("seed", [None, *range(10)])
def test_calls_stream_the_same_however_chunked(seed):
    parser, events, start, rng = call_events(QWEN3_CODER, TOOLS), [], 0, random.Random(seed)
    text = "Let me check.\n" + REPLY
    while start < len(text):
        size = len(text) if seed is None else rng.randint(1, 9)
        events += parser.feed(text[start:start + size])
        start += size
    assert summary(events + parser.finish(), parse=True) == ("Let me check.\n", EXPECTED)


def test_whole_replies_cut_ones_and_the_template():
    reply = parse_reply(REPLY, QWEN3_CODER, TOOLS)
    assert [(call["function"]["name"], json.loads(call["function"]["arguments"]))
            for call in reply.tool_calls] == EXPECTED
    cut = ADD_CALL[:40]
    assert parse_reply(cut, QWEN3_CODER, TOOLS).content == cut
    assert tool_call_format("{{ tools }} <tool_call> <function=x>") == QWEN3_CODER


@pytest.fixture(scope="module")
def backend():
    return llguidance_backend()


def test_the_grammar_holds_parameters_to_their_schemas(backend):
    required = tool_grammar(TOOLS, "required", True, QWEN3_CODER)
    assert takes(backend, required, REPLY)
    assert takes(backend, required, WEATHER_CALL.replace("<parameter=days>\n3\n</parameter>\n",
                                                         ""))  # optional
    assert not takes(backend, required, WEATHER_CALL.replace("celsius", "kelvin"))
    assert not takes(backend, required, WEATHER_CALL.replace("\n3\n", "\nthree\n"))
    assert not takes(backend, required, ADD_CALL.replace("\n-2\n", "\n2.5\n"))
    assert not takes(backend, required, "Hello")
    assert not takes(backend, tool_grammar(TOOLS, "required", False, QWEN3_CODER), REPLY)
    assert not takes(backend, tool_grammar(TOOLS, "add", True, QWEN3_CODER), WEATHER_CALL)
    auto = tool_grammar(TOOLS, "auto", True, QWEN3_CODER)
    assert takes(backend, auto, "Hello there") and takes(backend, auto, ADD_CALL)


def test_string_bounds_and_patterns_hold(backend):
    tools = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                  "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {
            "short": {"type": "string", "maxLength": 5},
            "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["short", "zip"]}}}]}).tools
    grammar = tool_grammar(tools, "required", False, QWEN3_CODER)

    def call(short: str, zip_code: str) -> str:
        return (f"<tool_call>\n<function=f>\n<parameter=short>\n{short}\n</parameter>\n"
                f"<parameter=zip>\n{zip_code}\n</parameter>\n</function>\n</tool_call>")

    assert takes(backend, grammar, call("abcde", "12345"))
    assert not takes(backend, grammar, call("abcdef", "12345"))
    assert not takes(backend, grammar, call("abc", "1234a"))
