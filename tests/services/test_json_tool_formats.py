"""The JSON tool-call formats (Llama 3's bare {"name", "parameters"} objects, Mistral's
[TOOL_CALLS] list), without a model: their grammars hold calls to the tools' schemas and the
format, and their streamed reading gives the name first and the arguments in pieces, the same
however the text is chunked; whole replies parse into OpenAI tool calls."""
from __future__ import annotations

import json
import random

import pytest

from kvrelay.gateway.openai_protocol import ChatCompletionRequest
from kvrelay.gateway.openai_tools import (ToolCallStream, call_events, parse_reply,
                                           tool_grammar)
from kvrelay.gateway.tool_call_events import CallArguments, CallEnd, CallStart
from kvrelay.tokenizer.tool_render import LLAMA3_JSON, MISTRAL, tool_call_format
from tests.services.tool_events import llguidance_backend, summary, takes

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}}, "required": ["city"], "additionalProperties": False}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"], "additionalProperties": False}}}
TOOLS = ChatCompletionRequest.model_validate(
    {"messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER, ADD]}).tools

REPLIES = {  # format -> (two calls as the grammar writes them, what they are)
    LLAMA3_JSON: ('{"name":"add","parameters":{"a":1,"b":{"c":"}"}}}; '
                  '{"name":"get_weather","parameters":{"city":"Rome"}}'),
    MISTRAL: ('[TOOL_CALLS][{"name":"add","arguments":{"a":1,"b":{"c":"}"}}}, '
              '{"name":"get_weather","arguments":{"city":"Rome"}}]'),
}
CALLS = [("add", '{"a":1,"b":{"c":"}"}}'), ("get_weather", '{"city":"Rome"}')]



def streamed(fmt: str, text: str, seed: int | None) -> list:
    parser, events, start = call_events(fmt), [], 0
    rng = random.Random(seed)
    while start < len(text):
        size = len(text) if seed is None else rng.randint(1, 7)
        events += parser.feed(text[start:start + size])
        start += size
    return events + parser.finish()


@pytest.mark.parametrize("fmt", [LLAMA3_JSON, MISTRAL])
@pytest.mark.parametrize("seed", [None, *range(10)])
def test_calls_stream_the_same_however_chunked(fmt, seed):
    assert summary(streamed(fmt, REPLIES[fmt], seed)) == ("", CALLS)


def test_the_name_comes_before_the_arguments_end():
    parser = call_events(LLAMA3_JSON)
    assert parser.feed('{"name":"add","parameters":') == []
    assert parser.feed('{"a":1') == [CallStart(0, "add"), CallArguments(0, '{"a":1')]
    assert parser.feed(',"b":2}') == [CallArguments(0, ',"b":2}'), CallEnd(0, '{"a":1,"b":2}')]


def test_text_replies_other_orders_and_python_tag():
    assert summary(streamed(LLAMA3_JSON, "Paris is sunny.", 3)) == ("Paris is sunny.", [])
    tagged = '<|python_tag|>{"name":"add","parameters":{"a":1,"b":2}}'
    assert summary(streamed(LLAMA3_JSON, tagged, 1))[1] == [("add", '{"a":1,"b":2}')]
    other_order = '[TOOL_CALLS][{"arguments": {"a": 1, "b": 2}, "name": "add"}]'
    assert summary(streamed(MISTRAL, other_order, 2))[1] == [("add", '{"a": 1, "b": 2}')]
    assert summary(streamed(MISTRAL, "Sure. " + REPLIES[MISTRAL], 4)) == ("Sure. ", CALLS)


def test_whole_replies_and_cut_ones():
    for fmt in (LLAMA3_JSON, MISTRAL):
        reply = parse_reply(REPLIES[fmt], fmt)
        assert reply.content is None
        assert [(call["function"]["name"], json.loads(call["function"]["arguments"]))
                for call in reply.tool_calls] == [(name, json.loads(arguments))
                                                  for name, arguments in CALLS]
    cut = '{"name":"add","parameters":{"a":1'
    assert parse_reply(cut, LLAMA3_JSON).tool_calls == []
    assert parse_reply(cut, LLAMA3_JSON).content == cut


def test_chat_deltas_put_the_name_first():
    stream = ToolCallStream(MISTRAL)
    deltas = stream.feed(REPLIES[MISTRAL])[1] + stream.finish()[1]
    assert deltas[0]["function"] == {"name": "add", "arguments": ""} and "id" in deltas[0]
    assert stream.num_calls == 2


@pytest.fixture(scope="module")
def backend():
    return llguidance_backend()


@pytest.mark.parametrize("fmt", [LLAMA3_JSON, MISTRAL])
def test_the_grammars_hold_calls_to_format_and_schema(backend, fmt):
    one = REPLIES[fmt].replace('"b":{"c":"}"}', '"b":2')
    required = tool_grammar(TOOLS, "required", True, fmt)
    assert takes(backend, required, one)
    assert not takes(backend, required, one.replace('"city":"Rome"', '"town":"Rome"'))
    assert not takes(backend, required, "Hello")
    single = tool_grammar(TOOLS, "required", False, fmt)
    assert not takes(backend, single, one)
    auto = tool_grammar(TOOLS, "auto", True, fmt)
    assert takes(backend, auto, "Hello there") and takes(backend, auto, one)
    named = tool_grammar(TOOLS, "get_weather", True, fmt)
    assert not takes(backend, named, one)


def test_the_format_is_read_from_the_template():
    assert tool_call_format("{{ tools }} [TOOL_CALLS]") == MISTRAL
    assert tool_call_format('{{ tools }} "parameters": <|python_tag|>') == LLAMA3_JSON
    assert tool_call_format("{{ tools }} <tool_call>") == "hermes"
    assert tool_call_format("no tools here") == "kvrelay"
    assert tool_call_format("anything", chosen=MISTRAL) == MISTRAL
