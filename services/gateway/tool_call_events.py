"""A reply's text, as it streams, split into content and tool-call events: each call's name as
soon as it is written, then its arguments' JSON text in pieces as it is generated, then the
call's end. Chat (OpenAI's tool-call deltas) and the Responses API (function_call items and
their argument deltas) both stream from these events.

A call is <tool_call>{"name": ..., "arguments": {...}}</tool_call> (hermes: the JSON on a line of
its own), the name before the arguments, as the tool grammar (openai_tools.py) writes it. A block
that does not read that way (a model without the grammar, a block cut by max_tokens) is held
until it closes and read whole; one that never parses goes out as content."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from kvrelay.tokenizer.tool_render import CALL_CLOSE, CALL_OPEN

# The head of a call block up to where its arguments begin.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*(?=\S)')
# The end of a call after its arguments: the object's brace, then the closing tag.
_TAIL = re.compile(r"\}\s*" + re.escape(CALL_CLOSE))
_BLOCK_END = re.compile(re.escape(CALL_CLOSE))


@dataclass(slots=True)
class Content:
    text: str


@dataclass(slots=True)
class CallStart:
    index: int  # the call's position among the reply's calls
    name: str


@dataclass(slots=True)
class CallArguments:
    index: int
    text: str  # the next piece of the arguments' JSON text


@dataclass(slots=True)
class CallEnd:
    index: int
    arguments: str  # the whole arguments' JSON text (the pieces joined)


Event = Content | CallStart | CallArguments | CallEnd


def run_steps(reader, text: str) -> list[Event]:
    """The loop every format's reader shares: the text joins what it holds, then its step runs
    until one waits for more text (returns False)."""
    reader.pending += text
    events: list[Event] = []
    while reader.step(events):
        pass
    return events


def held_back(text: str, tag: str) -> int:
    """How much of text's end may be the start of tag: held back until the next text tells."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


@dataclass(slots=True)
class ToolCallEvents:
    """One choice's text in, events out; `finish` flushes what is left at the end."""
    pending: str = ""
    in_calls: bool = False  # a call has opened: the rest is calls (and space between them)
    in_block: bool = False  # inside <tool_call>...</tool_call>
    streaming_args: bool = False  # the head was read; pending holds arguments text
    arguments: list[str] = field(default_factory=list)
    num_calls: int = 0

    def feed(self, text: str) -> list[Event]:
        return run_steps(self, text)

    def finish(self) -> list[Event]:
        """The end of the text: an unclosed or unreadable block goes out as content."""
        events: list[Event] = []
        if self.streaming_args:  # cut inside the arguments: the call is not whole
            events.append(CallEnd(self.num_calls, "".join(self.arguments) + self.pending))
            self.num_calls += 1
        elif self.pending.strip() or self.in_block or not self.in_calls:
            rest = (CALL_OPEN if self.in_block else "") + self.pending
            if rest:
                events.append(Content(rest))
        self.pending, self.streaming_args, self.in_block = "", False, False
        return events

    def step(self, events: list[Event]) -> bool:
        """Handle what pending holds; True while there may be more to do."""
        if self.streaming_args:
            return self._arguments(events)
        if self.in_block:
            return self._head(events)
        return self._outside(events)

    def _outside(self, events: list[Event]) -> bool:
        start = self.pending.find(CALL_OPEN)
        if start < 0:
            if not self.in_calls:
                keep = held_back(self.pending, CALL_OPEN)
                text = self.pending[:len(self.pending) - keep]
                if text:
                    events.append(Content(text))
                self.pending = self.pending[len(text):]
            return False
        before = self.pending[:start]
        if before and (not self.in_calls or before.strip()):
            events.append(Content(before))
        self.pending = self.pending[start + len(CALL_OPEN):]
        self.in_calls = self.in_block = True
        return True

    def _head(self, events: list[Event]) -> bool:
        head = _HEAD.match(self.pending)
        if head is not None:
            events.append(CallStart(self.num_calls, head.group(1)))
            self.pending = self.pending[head.end():]
            self.streaming_args, self.arguments = True, []
            return True
        end = _BLOCK_END.search(self.pending)
        if end is None:
            return False  # the head may still come
        block, self.pending = self.pending[:end.start()], self.pending[end.end():]
        self.in_block = False
        events.extend(self._whole_block(block))
        return True

    def _whole_block(self, block: str) -> list[Event]:
        try:
            parsed = json.loads(block)
            name, arguments = parsed["name"], parsed["arguments"]
        except (ValueError, KeyError, TypeError):
            return [Content(CALL_OPEN + block + CALL_CLOSE)]
        if not isinstance(name, str):
            return [Content(CALL_OPEN + block + CALL_CLOSE)]
        text = json.dumps(arguments, ensure_ascii=False)
        index, self.num_calls = self.num_calls, self.num_calls + 1
        return [CallStart(index, name), CallArguments(index, text), CallEnd(index, text)]

    def _arguments(self, events: list[Event]) -> bool:
        tail = _TAIL.search(self.pending)
        if tail is not None:
            self._emit_arguments(events, self.pending[:tail.start()].rstrip())
            self.pending = self.pending[tail.end():]
            events.append(CallEnd(self.num_calls, "".join(self.arguments)))
            self.num_calls += 1
            self.streaming_args = self.in_block = False
            return True
        keep = _tail_prefix_len(self.pending)
        self._emit_arguments(events, self.pending[:len(self.pending) - keep])
        self.pending = self.pending[len(self.pending) - keep:]
        return False

    def _emit_arguments(self, events: list[Event], text: str) -> None:
        if text:
            self.arguments.append(text)
            events.append(CallArguments(self.num_calls, text))


_TAIL_PREFIX = re.compile(r"\}\s*(<[/a-z_]*)?$")


def _tail_prefix_len(text: str) -> int:
    """How much of text's end may be the start of the call's end (the object's closing brace,
    space, the closing tag's first characters): held back until it is known."""
    brace = text.rfind("}")
    if brace < 0:
        return 0
    match = _TAIL_PREFIX.match(text, brace)
    if match is None or not CALL_CLOSE.startswith(match.group(1) or ""):
        return 0
    return len(text) - brace
