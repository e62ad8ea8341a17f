"""The streamed split of a reply into content and tool-call events (tool_call_events.py): the
name as soon as it is written, the arguments in pieces before the call closes, the same events
however the text is chunked, and blocks that are cut or unreadable kept as content."""
from __future__ import annotations

import json
import random

import pytest

from kvrelay.gateway.tool_call_events import (CallArguments, CallEnd, CallStart, Content,
                                              ToolCallEvents)
from tests.services.tool_events import summary

COMPACT = ('<tool_call>{"name":"add","arguments":{"a":1,"b":{"c":"}"}}}</tool_call>'
           '<tool_call>{"name":"get_weather","arguments":{"city":"Rome"}}</tool_call>')
HERMES = ('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>\n'
          '<tool_call>\n{"name": "add", "arguments": {"a": 2}}\n</tool_call>')


def run(text: str, chunks: list[int]) -> list:
    parser, events, start = ToolCallEvents(), [], 0
    for size in chunks:
        events += parser.feed(text[start:start + size])
        start += size
    events += parser.feed(text[start:])
    return events + parser.finish()



def random_chunks(text: str, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 9) for _ in range(len(text) // 3)]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("text", [COMPACT, HERMES, "Let me see. " + COMPACT])
def test_events_do_not_depend_on_the_chunking(text, seed):
    assert summary(run(text, random_chunks(text, seed))) == summary(run(text, []))


def test_calls_and_their_arguments_as_written():
    content, calls = summary(run("Let me see. " + COMPACT, []))
    assert content == "Let me see. "
    assert calls == [("add", '{"a":1,"b":{"c":"}"}}'), ("get_weather", '{"city":"Rome"}')]
    _, hermes = summary(run(HERMES, []))
    assert [json.loads(arguments) for _, arguments in hermes] == [{"a": 1}, {"a": 2}]


def test_the_name_and_arguments_stream_before_the_call_closes():
    parser = ToolCallEvents()
    assert parser.feed("<tool_call>{\"name\":\"add\",") == []
    assert parser.feed('"arguments":') == []  # space may follow
    assert parser.feed('{"a":1') == [CallStart(0, "add"), CallArguments(0, '{"a":1')]
    assert parser.feed("}") == []  # may be the call's own closing brace: held back
    assert parser.feed("}</tool") == [CallArguments(0, "}")]
    assert parser.feed("_call>") == [CallEnd(0, '{"a":1}')]
    assert parser.finish() == []


def test_content_that_only_looks_like_a_tag_is_released():
    parser = ToolCallEvents()
    assert parser.feed("a <tool") == [Content("a ")]
    assert parser.feed("bar>") == [Content("<toolbar>")]
    assert parser.finish() == []


def test_cut_and_unreadable_blocks():
    # max_tokens cut inside the arguments: the call ends with what was written
    cut = run('<tool_call>{"name":"add","arguments":{"a":', [])
    assert summary(cut) == ("", [("add", '{"a":')])
    # cut before the name: the text is content
    assert summary(run('<tool_call>{"na', [])) == ('<tool_call>{"na', [])
    # a block that is no call stays content; a whole one in another key order is read whole
    assert summary(run("<tool_call>nope</tool_call>", [])) == \
        ("<tool_call>nope</tool_call>", [])
    other_order = '<tool_call>{"arguments": {"a": 1}, "name": "add"}</tool_call>'
    assert summary(run(other_order, [3, 5])) == ("", [("add", '{"a": 1}')])
