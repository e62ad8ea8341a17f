"""Tool calls written as bare JSON objects, as Llama 3.x (`{"name": ..., "parameters": {...}}`,
several joined by "; ", after an optional <|python_tag|>) and Mistral (`[TOOL_CALLS][{"name":
..., "arguments": {...}}, ...]`) write them: the reply's text, as it streams, into the events of
tool_call_events.py (content, each call's name once written, its arguments' JSON text in pieces
as generated, its end). The arguments' end is found by following the JSON (its depth, its
strings), so nothing is held back but the call's head."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from kvrelay.gateway.tool_call_events import (CallArguments, CallEnd, CallStart, Content, Event,
                                              held_back, run_steps)


@dataclass(frozen=True, slots=True)
class JsonCallSyntax:
    arguments_key: str  # "parameters" (Llama 3) or "arguments" (Mistral)
    opener: str  # what opens the calls ("" for Llama 3: its reply starts with the first call)
    separator: str  # between two calls
    closer: str  # after the last call ("" for none)
    calls_only_at_start: bool  # Llama 3: a reply is text or calls, never text then calls
    optional_prefix: str = ""  # Llama 3's <|python_tag|>, which may open the calls

    def arguments_seen(self) -> re.Pattern:
        return re.compile(r'"' + re.escape(self.arguments_key) + r'"\s*:\s*\S')

    def head(self) -> re.Pattern:
        return re.compile(r'\s*\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"'
                          + re.escape(self.arguments_key) + r'"\s*:\s*(?=\S)')


LLAMA3_JSON_SYNTAX = JsonCallSyntax("parameters", "", "; ", "", True, "<|python_tag|>")
MISTRAL_SYNTAX = JsonCallSyntax("arguments", "[TOOL_CALLS][", ", ", "]", False)


class JsonDepth:
    """Follows JSON text a piece at a time: where its top-level value ends."""

    def __init__(self) -> None:
        self.depth, self.in_string, self.escaped, self.started = 0, False, False, False

    def end_in(self, text: str) -> int:
        """The index just past the value's end in text, or -1 if it goes on."""
        for index, char in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == '"':
                    self.in_string = False
                    if self.depth == 0:
                        return index + 1
                continue
            if char == '"':
                self.in_string, self.started = True, True
            elif char in "{[":
                self.depth, self.started = self.depth + 1, True
            elif char in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return index + 1
            elif self.started and self.depth == 0 and char in ",;] \n":
                return index  # a bare number, true, false or null ended
            elif not char.isspace():
                self.started = True
        return -1


@dataclass(slots=True)
class JsonCallEvents:
    syntax: JsonCallSyntax
    pending: str = ""
    state: str = "start"  # start, content, between, head, arguments, tail, whole, done
    num_calls: int = 0
    arguments: list[str] = field(default_factory=list)
    depth: JsonDepth | None = None

    def feed(self, text: str) -> list[Event]:
        return run_steps(self, text)

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self.state == "arguments":  # cut inside the arguments: the call is not whole
            events.append(CallEnd(self.num_calls, "".join(self.arguments) + self.pending))
            self.num_calls += 1
        elif self.state in ("start", "content") or (self.pending.strip()
                                                    and self.state != "done"):
            if self.pending:
                events.append(Content(self.pending))
        self.pending, self.state = "", "done"
        return events

    def step(self, events: list[Event]) -> bool:
        handler = {"start": self._start, "content": self._content, "head": self._head,
                   "arguments": self._arguments, "tail": self._tail,
                   "between": self._between, "whole": self._whole}.get(self.state)
        return handler(events) if handler is not None else False

    def _start(self, events: list[Event]) -> bool:
        """Llama 3: the reply is calls if it opens with one (or the python tag)."""
        if not self.syntax.calls_only_at_start:
            self.state = "content"
            return True
        head = self.pending.lstrip()
        prefix = self.syntax.optional_prefix
        if not head or (prefix and prefix.startswith(head)):
            return False  # not known yet
        if prefix and head.startswith(prefix):
            head = head[len(prefix):]
        if head.lstrip().startswith("{") or (not head.strip() and self.pending.lstrip()):
            self.pending, self.state = head, "head"
            return True
        self.state = "content"
        return True

    def _content(self, events: list[Event]) -> bool:
        opener = self.syntax.opener
        if self.syntax.calls_only_at_start or not opener:
            if self.pending:
                events.append(Content(self.pending))
            self.pending = ""
            return False
        start = self.pending.find(opener)
        if start >= 0:
            if start:
                events.append(Content(self.pending[:start]))
            self.pending, self.state = self.pending[start + len(opener):], "head"
            return True
        keep = held_back(self.pending, opener)
        if len(self.pending) > keep:
            events.append(Content(self.pending[:len(self.pending) - keep]))
            self.pending = self.pending[len(self.pending) - keep:]
        return False

    def _head(self, events: list[Event]) -> bool:
        head = self.syntax.head().match(self.pending)
        if head is not None:
            events.append(CallStart(self.num_calls, head.group(1)))
            self.pending = self.pending[head.end():]
            self.state, self.arguments, self.depth = "arguments", [], JsonDepth()
            return True
        # The arguments came before the name (or no head at all): read the call whole.
        if self.syntax.arguments_seen().search(self.pending) or len(self.pending) > 512:
            self.state = "whole"
            return True
        return False

    def _arguments(self, events: list[Event]) -> bool:
        end = self.depth.end_in(self.pending)
        piece = self.pending if end < 0 else self.pending[:end]
        if piece:
            self.arguments.append(piece)
            events.append(CallArguments(self.num_calls, piece))
        self.pending = "" if end < 0 else self.pending[end:]
        if end < 0:
            return False
        events.append(CallEnd(self.num_calls, "".join(self.arguments)))
        self.num_calls += 1
        self.state = "tail"
        return True

    def _tail(self, events: list[Event]) -> bool:
        """The call object's own closing brace."""
        stripped = self.pending.lstrip()
        if not stripped:
            return False
        if stripped[0] != "}":
            events.append(Content(self.pending))
            self.pending, self.state = "", "content"
            return True
        self.pending, self.state = stripped[1:], "between"
        return True

    def _between(self, events: list[Event]) -> bool:
        syntax = self.syntax
        text = self.pending
        for mark, state in ((syntax.separator.strip(), "head"), (syntax.closer, "done")):
            if mark and text.lstrip().startswith(mark):
                self.pending = text.lstrip()[len(mark):]
                self.state = state
                return True
        if text.strip() and not any(mark.startswith(text.strip()) for mark in
                                    (syntax.separator.strip(), syntax.closer) if mark):
            events.append(Content(text))  # not a call: what follows is the model's text
            self.pending, self.state = "", "content"
            return True
        return False

    def _whole(self, events: list[Event]) -> bool:
        end = JsonDepth().end_in(self.pending)  # pending keeps the whole call: scan it anew
        if end < 0:
            return False
        block, self.pending = self.pending[:end], self.pending[end:]
        try:
            parsed = json.loads(block)
            name, arguments = parsed["name"], parsed[self.syntax.arguments_key]
        except (ValueError, KeyError, TypeError):
            events.append(Content(block))
            self.state = "content"
            return True
        text = json.dumps(arguments, ensure_ascii=False)
        events += [CallStart(self.num_calls, name), CallArguments(self.num_calls, text),
                   CallEnd(self.num_calls, text)]
        self.num_calls += 1
        self.state = "between"
        return True
