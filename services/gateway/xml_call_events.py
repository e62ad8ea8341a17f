"""Tool calls in Qwen3-Coder's XML, as its template teaches them:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

read as they stream into the events of tool_call_events.py: the name once its tag is written,
then the arguments as JSON text, one parameter at a time as each closes (a string parameter's
value is the raw text; any other's is JSON, read by the tool's parameter schema), then the end.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from kvrelay.gateway.tool_call_events import (CallArguments, CallEnd, CallStart, Content, Event,
                                              held_back, run_steps)
from kvrelay.tokenizer.tool_render import CALL_CLOSE, CALL_OPEN

_FUNCTION = re.compile(r"\s*<function=([A-Za-z0-9_-]{1,64})>\n?")
_PARAMETER = re.compile(r"\s*<parameter=([A-Za-z0-9_.-]{1,64})>")
_PARAMETER_CLOSE = "</parameter>"
_FUNCTION_CLOSE = re.compile(r"\s*</function>\s*" + re.escape(CALL_CLOSE))


def parameter_value(text: str, schema: dict | None):
    """A parameter's value: the text as it is for a string (or an unknown parameter), else
    its JSON (the text itself where it is not JSON)."""
    kinds = _types(schema)
    if not kinds or "string" in kinds and len(kinds) == 1:
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def _types(schema: dict | None) -> set[str]:
    if not schema:
        return set()
    if "enum" in schema:
        return {type(value).__name__.replace("str", "string") for value in schema["enum"]}
    kind = schema.get("type")
    if isinstance(kind, list):
        return set(kind)
    if kind:
        return {kind}
    return set().union(*(_types(option) for option in schema.get("anyOf", [])))


@dataclass(slots=True)
class XmlCallEvents:
    parameters: dict[str, dict]  # function name -> its parameters' schemas (properties)
    pending: str = ""
    state: str = "outside"  # outside, function, parameters, value
    num_calls: int = 0
    name: str = ""
    parameter: str = ""
    arguments: list[str] = field(default_factory=list)

    def feed(self, text: str) -> list[Event]:
        return run_steps(self, text)

    def finish(self) -> list[Event]:
        events: list[Event] = []
        if self.state in ("parameters", "value"):  # cut inside the call: it is not whole
            events.append(CallEnd(self.num_calls, "".join(self.arguments)))
            self.num_calls += 1
        elif self.state == "function" or self.pending.strip():
            prefix = CALL_OPEN if self.state == "function" else ""
            events.append(Content(prefix + self.pending))
        self.pending, self.state = "", "done"
        return events

    def step(self, events: list[Event]) -> bool:
        handler = {"outside": self._outside, "function": self._function,
                   "parameters": self._parameters, "value": self._value}.get(self.state)
        return handler(events) if handler is not None else False

    def _outside(self, events: list[Event]) -> bool:
        start = self.pending.find(CALL_OPEN)
        if start < 0:
            keep = held_back(self.pending, CALL_OPEN)
            text = self.pending[:len(self.pending) - keep]
            if text and (self.num_calls == 0 or text.strip()):
                events.append(Content(text))
            self.pending = self.pending[len(text):]
            return False
        before = self.pending[:start]
        if before and (self.num_calls == 0 or before.strip()):
            events.append(Content(before))
        self.pending, self.state = self.pending[start + len(CALL_OPEN):], "function"
        return True

    def _function(self, events: list[Event]) -> bool:
        match = _FUNCTION.match(self.pending)
        if match is None:
            if len(self.pending) > 200 or CALL_CLOSE in self.pending:
                events.append(Content(CALL_OPEN + self.pending))
                self.pending, self.state = "", "outside"
                return True
            return False
        self.name, self.arguments = match.group(1), ["{"]
        self.pending, self.state = self.pending[match.end():], "parameters"
        events += [CallStart(self.num_calls, self.name), CallArguments(self.num_calls, "{")]
        return True

    def _parameters(self, events: list[Event]) -> bool:
        end = _FUNCTION_CLOSE.match(self.pending)
        if end is not None:
            self.arguments.append("}")
            events += [CallArguments(self.num_calls, "}"),
                       CallEnd(self.num_calls, "".join(self.arguments))]
            self.num_calls += 1
            self.pending, self.state = self.pending[end.end():], "outside"
            return True
        match = _PARAMETER.match(self.pending)
        if match is None:
            return False
        self.parameter = match.group(1)
        self.pending, self.state = self.pending[match.end():], "value"
        return True

    def _value(self, events: list[Event]) -> bool:
        end = self.pending.find(_PARAMETER_CLOSE)
        if end < 0:
            return False
        text = self.pending[:end]  # the value, between a newline after the tag and one before
        text = text[1:] if text.startswith("\n") else text
        text = text[:-1] if text.endswith("\n") else text
        schema = self.parameters.get(self.name, {}).get(self.parameter)
        value = parameter_value(text, schema)
        piece = ("" if len(self.arguments) == 1 else ", ") + \
            json.dumps(self.parameter) + ": " + json.dumps(value, ensure_ascii=False)
        self.arguments.append(piece)
        events.append(CallArguments(self.num_calls, piece))
        self.pending = self.pending[end + len(_PARAMETER_CLOSE):]
        self.state = "parameters"
        return True
