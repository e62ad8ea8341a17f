"""Tool calls as a Python list of calls, as Llama 3.2/4's pythonic templates teach them:

    [get_weather(city="Paris", unit="celsius"), add(a=1, b=2)]

read as they stream into the events of tool_call_events.py: the name once its "(" is written,
then the arguments as JSON text, one keyword argument at a time as each value ends (a Python
literal: strings in either quotes, numbers, True/False/None, lists, dicts; JSON's true, false
and null read too), then the call's end. A reply that does not open with "[" is text."""
from __future__ import annotations

import ast
import json
import re
from dataclasses import dataclass, field

from kvrelay.gateway.tool_call_events import (CallArguments, CallEnd, CallStart, Content, Event,
                                              run_steps)

_CALL = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_-]{0,63})\(")
_KEYWORD = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*")
_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False,
          "null": None}


def python_value(text: str):
    """A Python literal's value (JSON's true/false/null too); raises ValueError."""
    try:
        return _value(ast.parse(text.strip(), mode="eval").body)
    except SyntaxError:
        raise ValueError(f"not a Python literal: {text!r}") from None


def _value(node):
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_value(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        return {_value(key): _value(value) for key, value in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _value(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    raise ValueError(f"not a literal: {ast.dump(node)}")


class _LiteralEnd:
    """Follows a Python literal a piece at a time: where it ends (a "," or ")" outside any
    string or bracket)."""

    def __init__(self) -> None:
        self.depth, self.quote, self.escaped = 0, "", False

    def end_in(self, text: str) -> int:
        for index, char in enumerate(text):
            if self.quote:
                if self.escaped:
                    self.escaped = False
                elif char == "\\":
                    self.escaped = True
                elif char == self.quote:
                    self.quote = ""
            elif char in "\"'":
                self.quote = char
            elif char in "([{":
                self.depth += 1
            elif char in ")]}":
                if self.depth == 0:
                    return index
                self.depth -= 1
            elif char == "," and self.depth == 0:
                return index
        return -1


@dataclass(slots=True)
class PythonicCallEvents:
    pending: str = ""
    state: str = "start"  # start, content, call, keyword, value, after, done
    num_calls: int = 0
    arguments: list[str] = field(default_factory=list)
    keyword: str = ""
    value: list[str] = field(default_factory=list)
    literal: _LiteralEnd | None = None

    def feed(self, text: str) -> list[Event]:
        return run_steps(self, text)

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self.state in ("keyword", "value"):  # cut inside a call: it is not whole
            events.append(CallEnd(self.num_calls, "".join(self.arguments)))
            self.num_calls += 1
        elif self.state in ("start", "content") and self.pending:
            events.append(Content(self.pending))
        self.pending, self.state = "", "done"
        return events

    def step(self, events: list[Event]) -> bool:
        handler = {"start": self._start, "content": self._content, "call": self._call,
                   "keyword": self._keyword, "value": self._value,
                   "after": self._after}.get(self.state)
        return handler(events) if handler is not None else False

    def _start(self, events: list[Event]) -> bool:
        head = self.pending.lstrip()
        if not head:
            return False
        if head.startswith("["):
            self.pending, self.state = head[1:], "call"
        else:
            self.state = "content"
        return True

    def _content(self, events: list[Event]) -> bool:
        if self.pending:
            events.append(Content(self.pending))
        self.pending = ""
        return False

    def _call(self, events: list[Event]) -> bool:
        match = _CALL.match(self.pending)
        if match is None:
            return False
        events += [CallStart(self.num_calls, match.group(1)), CallArguments(self.num_calls, "{")]
        self.arguments = ["{"]
        self.pending, self.state = self.pending[match.end():], "keyword"
        return True

    def _keyword(self, events: list[Event]) -> bool:
        stripped = self.pending.lstrip()
        if stripped.startswith(")"):
            self.arguments.append("}")
            events += [CallArguments(self.num_calls, "}"),
                       CallEnd(self.num_calls, "".join(self.arguments))]
            self.num_calls += 1
            self.pending, self.state = stripped[1:], "after"
            return True
        if stripped.startswith(","):
            self.pending = stripped[1:]
            return True
        match = _KEYWORD.match(self.pending)
        if match is None:
            return False
        self.keyword, self.value, self.literal = match.group(1), [], _LiteralEnd()
        self.pending, self.state = self.pending[match.end():], "value"
        return True

    def _value(self, events: list[Event]) -> bool:
        end = self.literal.end_in(self.pending)
        if end < 0:
            self.value.append(self.pending)
            self.pending = ""
            return False
        self.value.append(self.pending[:end])
        self.pending, self.state = self.pending[end:], "keyword"
        text = "".join(self.value)
        try:
            value = python_value(text)
        except ValueError:
            value = text.strip()
        piece = ("" if len(self.arguments) == 1 else ", ") + json.dumps(self.keyword) + ": " + \
            json.dumps(value, ensure_ascii=False)
        self.arguments.append(piece)
        events.append(CallArguments(self.num_calls, piece))
        return True

    def _after(self, events: list[Event]) -> bool:
        stripped = self.pending.lstrip()
        if not stripped:
            return False
        if stripped.startswith(","):
            self.pending, self.state = stripped[1:], "call"
        elif stripped.startswith("]"):
            self.pending, self.state = stripped[1:], "done"
        else:
            events.append(Content(stripped))
            self.pending, self.state = "", "content"
        return True
