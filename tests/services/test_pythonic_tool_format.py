"""Pythonic tool calls (Llama 3.2's `[name(key=value, ...)]`), without a model: the grammar holds
each keyword argument to its schema and the format, the streamed reading gives the name first
and the arguments as JSON a keyword at a time, the same however the text is chunked, and whole
replies parse into OpenAI tool calls."""
from __future__ import annotations

import json
import random

import pytest

from kvrelay.gateway.openai_protocol import ChatCompletionRequest
from kvrelay.gateway.openai_tools import call_events, parse_reply, tool_grammar
from kvrelay.gateway.pythonic_call_events import python_value
from kvrelay.tokenizer.tool_render import PYTHONIC, tool_call_format
from tests.services.tool_events import llguidance_backend, summary, takes

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                     "unit": {"enum": ["celsius", "fahrenheit"]},
                                     "hot": {"type": "boolean"}},
    "required": ["city"]}}}
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
    "required": ["a", "b"]}}}
TOOLS = ChatCompletionRequest.model_validate(
    {"messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER, ADD]}).tools
REPLY = '[get_weather(city="Rome, (IT)", unit="celsius", hot=True), add(a=1, b=-2)]'
EXPECTED = [("get_weather", {"city": "Rome, (IT)", "unit": "celsius", "hot": True}),
            ("add", {"a": 1, "b": -2})]



@pytest.mark.parametrize("seed", [None, *range(10)])
def test_calls_stream_the_same_however_chunked(seed):
    parser, events, start, rng = call_events(PYTHONIC), [], 0, random.Random(seed)
    while start < len(REPLY):
        size = len(REPLY) if seed is None else rng.randint(1, 6)
        events += parser.feed(REPLY[start:start + size])
        start += size
    assert summary(events + parser.finish(), parse=True) == ("", EXPECTED)


def test_literals_text_and_cut_replies():
    assert python_value("{'a': [1, 'x'], 'b': None}") == {"a": [1, "x"], "b": None}
    assert python_value("[true, null]") == [True, None]  # JSON's names read too
    with pytest.raises(ValueError):
        python_value("os.system('x')")
    assert summary(call_events(PYTHONIC).feed("Rome is sunny.")) == ("Rome is sunny.", [])
    whole = parse_reply(REPLY, PYTHONIC)
    assert [(call["function"]["name"], json.loads(call["function"]["arguments"]))
            for call in whole.tool_calls] == EXPECTED
    assert parse_reply(REPLY[:30], PYTHONIC).content == REPLY[:30]
    assert tool_call_format("{{ tools }} [func_name1(params_name1=params_value1)]") == PYTHONIC


@pytest.fixture(scope="module")
def backend():
    return llguidance_backend()


def test_the_grammar_holds_arguments_to_their_schemas(backend):
    required = tool_grammar(TOOLS, "required", True, PYTHONIC)
    assert takes(backend, required, REPLY)
    assert takes(backend, required, '[get_weather(city="Oslo")]')  # the optional ones left out
    assert not takes(backend, required, '[get_weather(unit="celsius")]')  # city is required
    assert not takes(backend, required, '[get_weather(city="Oslo", hot=true)]')
    assert not takes(backend, required, '[add(a=1, b=2.5)]')
    assert not takes(backend, required, "Hello")
    assert not takes(backend, tool_grammar(TOOLS, "required", False, PYTHONIC), REPLY)
    auto = tool_grammar(TOOLS, "auto", True, PYTHONIC)
    assert takes(backend, auto, "Hello there") and takes(backend, auto, '[add(a=1, b=2)]')
