"""Tool calling, the gateway's side: the conversation's calls and results checked and passed to
the tokenizer, which renders them and the tools with the model's own template where it has
Hermes-style tool support, else in kvrelay's default format (services/tokenizer/tool_render.py);
the grammar that holds the model's calls to the tools' parameter schemas, in the format the
prompt taught; and the calls read back out of the text (whole, or as OpenAI's streamed
tool-call deltas). Either way the model calls a tool as <tool_call>{"name": ..., "arguments":
{...}}</tool_call> (hermes: the JSON on a line of its own). With tool_choice "required" or a
named function the output is nothing but calls; with "auto" it is either text (which may not
start with "<") or calls, and once a call starts its JSON is held to the schemas.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass

from kvrelay.engine.structured.spec import StructuredOutputs
from kvrelay.gateway.errors import invalid
from kvrelay.gateway.tool_call_events import (CallArguments, CallEnd, CallStart, Content,
                                              ToolCallEvents)
from kvrelay.gateway.json_call_events import JsonCallEvents, LLAMA3_JSON_SYNTAX, MISTRAL_SYNTAX
from kvrelay.gateway.pythonic_call_events import PythonicCallEvents
from kvrelay.gateway.xml_call_events import XmlCallEvents
from kvrelay.tokenizer.tool_render import (CALL_CLOSE, CALL_OPEN, HERMES, KVRELAY, LLAMA3_JSON,
                                           MISTRAL, PYTHONIC, QWEN3_CODER)

_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
_COMPACT = {"whitespace_flexible": False}  # as for response_format (llguidance_backend.py)


def tool_choice_mode(tools: list | None, tool_choice) -> str | None:
    """None (no tools in play), "auto", "required", or the name of the one function."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return None
    if tool_choice is None:
        return "auto"
    if tool_choice == "none":
        return None
    if isinstance(tool_choice, str):
        return tool_choice
    name = tool_choice.function.name
    if name not in {tool.function.name for tool in tools}:
        raise invalid(f"tool_choice names {name!r}, which is not among the tools",
                      "tool_choice")
    return name


def chat_messages(messages) -> list[dict]:
    """The conversation as the tokenizer renders it (tool_render.py): each message's text, and
    an assistant's tool calls with their arguments parsed (a 400 where they are not a JSON
    object), a tool result's tool_call_id, a name where given."""
    converted = []
    for message in messages:
        entry = {"role": message.role, "content": message.text()}
        if message.tool_calls:
            entry["tool_calls"] = [{"name": call.function.name,
                                    "arguments": parsed_arguments(call.function.name,
                                                                  call.function.arguments)}
                                   for call in message.tool_calls]
        if message.tool_call_id:
            entry["tool_call_id"] = message.tool_call_id
        if message.name:
            entry["name"] = message.name
        converted.append(entry)
    return converted


def tools_in_play(tools, mode: str | None) -> list[dict] | None:
    """The tool definitions the prompt lists: none with tool_choice "none"."""
    if mode is None:
        return None
    return [tool.model_dump(by_alias=True, exclude_none=True) for tool in tools]


def parsed_arguments(name: str, arguments: str, param: str = "messages") -> dict:
    """A call's arguments as an object; a 400 naming `param` where they are not one."""
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        raise invalid(f"tool call arguments of {name!r} are not a JSON object", param)
    return parsed


def tool_grammar(tools, mode: str, parallel: bool, fmt: str = KVRELAY) -> StructuredOutputs:
    """A Lark grammar (llguidance's, with %json for the call objects) for the mode, in the
    format the prompt taught (tool_render.py): hermes puts each call's JSON on a line of its own
    and calls on lines of their own; llama3_json and mistral write bare JSON objects."""
    chosen = [tool for tool in tools if mode in ("auto", "required") or
              tool.function.name == mode]
    several = parallel and mode in ("auto", "required")
    if fmt in (LLAMA3_JSON, MISTRAL):
        return _json_call_grammar(chosen, mode, several, fmt)
    if fmt == QWEN3_CODER:
        return _xml_call_grammar(chosen, mode, several)
    if fmt == PYTHONIC:
        return _pythonic_call_grammar(chosen, mode, several)
    call_schema = {"anyOf": [_call_schema(tool) for tool in chosen], "x-guidance": _COMPACT}
    line = "\\n" if fmt == HERMES else ""  # a newline, as Lark reads a string literal
    calls = (f'calls: call ("{line}" call)*' if line else "calls: call+") if several \
        else "calls: call"
    rules = [calls,
             f'call: "{CALL_OPEN}{line}" call_json "{line}{CALL_CLOSE}"',
             f"call_json: %json {json.dumps(call_schema)}"]
    if mode == "auto":  # text that cannot open a call, or calls
        start = ["start: TEXT | calls", "TEXT: /(?s:.+)/ & ~/<(?s:.*)/"]
    else:
        start = ["start: calls"]
    return StructuredOutputs("grammar", "\n".join(start + rules))


def _json_call_grammar(chosen, mode: str, several: bool, fmt: str) -> StructuredOutputs:
    """Llama 3: `{"name": ..., "parameters": {...}}`, several joined by "; "; Mistral:
    `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`. With "auto", text that cannot open
    a call, or calls."""
    key = "parameters" if fmt == LLAMA3_JSON else "arguments"
    call_schema = {"anyOf": [_call_schema(tool, key) for tool in chosen],
                   "x-guidance": _COMPACT}
    if fmt == LLAMA3_JSON:
        calls = 'calls: call ("; " call)*' if several else "calls: call"
        text = r"TEXT: /(?s:.+)/ & ~/[ \t\n]*[{<](?s:.*)/"
    else:
        calls = ('calls: "[TOOL_CALLS][" call (", " call)* "]"' if several
                 else 'calls: "[TOOL_CALLS][" call "]"')
        text = r"TEXT: /(?s:.+)/ & ~/[ \t\n]*\[(?s:.*)/"
    rules = [calls, f"call: %json {json.dumps(call_schema)}"]
    start = ["start: TEXT | calls", text] if mode == "auto" else ["start: calls"]
    return StructuredOutputs("grammar", "\n".join(start + rules))


def _xml_call_grammar(chosen, mode: str, several: bool) -> StructuredOutputs:
    """Qwen3-Coder: <tool_call>, <function=NAME>, each parameter in <parameter=P> tags (in the
    schema's order, the optional ones optional), a string's value as raw text (an enum's: one
    of its values), any other's as JSON held to its schema. With "auto", text that cannot open
    a call, or calls."""
    rules, calls = [], []
    for index, tool in enumerate(chosen):
        parameters = tool.function.parameters or {}
        required = set(parameters.get("required", []))
        parts = []
        for number, (name, schema) in enumerate(parameters.get("properties", {}).items()):
            rule = f"p{index}_{number}"
            rules.append(f"{rule}: {json.dumps(f'<parameter={name}>' + chr(10))} "
                         f"{_xml_value(rule, schema, rules)}")
            parts.append(rule if name in required else f"{rule}?")
        head = json.dumps(f"{CALL_OPEN}\n<function={tool.function.name}>\n")
        tail = json.dumps(f"</function>\n{CALL_CLOSE}")
        rules.append(f"call{index}: {head} {' '.join(parts)} {tail}")
        calls.append(f"call{index}")
    rules.append("call: " + " | ".join(calls))
    rules.append('calls: call ("\\n" call)*' if several else "calls: call")
    start = ["start: TEXT | calls", "TEXT: /(?s:.+)/ & ~/<(?s:.*)/"] if mode == "auto" \
        else ["start: calls"]
    return StructuredOutputs("grammar", "\n".join(start + rules))


# A string parameter's raw text with the tag that closes it, as one lexeme (the lexer cannot
# split free text from the closing tag that follows it), bounded as the schema bounds it.
_XML_CLOSE = json.dumps("\n</parameter>\n")
_NO_SECOND_CLOSE = r"~/(?s:.*)<\/parameter>(?s:.*)<\/parameter>(?s:.*)/"


def _xml_value(rule: str, schema: dict, rules: list[str]) -> str:
    if _is_text(schema):
        if "enum" in schema:
            return "(" + " | ".join(json.dumps(value) for value in schema["enum"]) + ") " + \
                _XML_CLOSE
        terminal = rule.upper() + "_TEXT"
        rules.append(f"{terminal}: /{_text_regex(schema)}\\n<\\/parameter>\\n/ & "
                     f"{_NO_SECOND_CLOSE}")
        return terminal
    rules.append(f"{rule}_json: %json {json.dumps({**schema, 'x-guidance': _COMPACT})}")
    return f"{rule}_json {_XML_CLOSE}"


def _text_regex(schema: dict) -> str:
    """A string's raw text: its pattern (unanchored), else any text within its length bounds."""
    pattern = schema.get("pattern")
    if pattern:
        return "(?:" + pattern.removeprefix("^").removesuffix("$").replace("/", "\\/") + ")"
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    return f"(?s:.{{{low},{'' if high is None else high}}})"


def _is_text(schema: dict) -> bool:
    if "enum" in schema:
        return all(isinstance(value, str) for value in schema["enum"])
    return schema.get("type") == "string"


def _pythonic_call_grammar(chosen, mode: str, several: bool) -> StructuredOutputs:
    """Llama 3.2's pythonic calls: `[name(key=value, ...), ...]`, the keyword arguments in the
    schema's order (the optional ones optional), each value a Python literal held to its schema
    (booleans True/False, None, strings of an enum; anything else JSON, which Python reads
    alike). With "auto", text that cannot open the list, or calls."""
    rules, calls = [], []
    for index, tool in enumerate(chosen):
        parameters = tool.function.parameters or {}
        required = set(parameters.get("required", []))
        keywords = []
        for number, (name, schema) in enumerate(parameters.get("properties", {}).items()):
            rule = f"k{index}_{number}"
            rules.append(f"{rule}: {json.dumps(name + '=')} {_python_value(rule, schema, rules)}")
            keywords.append((rule, name in required))
        arguments = _keyword_sequence(keywords)
        if arguments:
            rules.append(f"args{index}: {arguments}")
        optional = "?" if not any(needed for _, needed in keywords) else ""
        body = f" args{index}{optional}" if arguments else ""
        rules.append(f'call{index}: {json.dumps(tool.function.name + "(")}{body} ")"')
        calls.append(f"call{index}")
    rules.append("call: " + " | ".join(calls))
    rules.append('calls: "[" call (", " call)* "]"' if several else 'calls: "[" call "]"')
    start = (["start: TEXT | calls", r"TEXT: /(?s:.+)/ & ~/[ \t\n]*\[(?s:.*)/"]
             if mode == "auto" else ["start: calls"])
    return StructuredOutputs("grammar", "\n".join(start + rules))


def _keyword_sequence(keywords: list[tuple[str, bool]]) -> str:
    """Keyword arguments in order joined by ", ", each optional one optional: one alternative
    per argument that may come first (none before it is required)."""
    options = []
    for first, (rule, _) in enumerate(keywords):
        tail = " ".join(f'(", " {other})' + ("" if needed else "?")
                        for other, needed in keywords[first + 1:])
        options.append(f"{rule} {tail}".strip())
        if keywords[first][1]:
            break  # a required argument cannot be skipped
    return " | ".join(f"({option})" for option in options)


def _python_value(rule: str, schema: dict, rules: list[str]) -> str:
    if schema.get("type") == "boolean":
        return '("True" | "False")'
    if schema.get("type") == "null":
        return '"None"'
    if "enum" in schema and all(isinstance(value, str) for value in schema["enum"]):
        return "(" + " | ".join(json.dumps(json.dumps(value)) for value in schema["enum"]) + ")"
    rules.append(f"{rule}_json: %json {json.dumps({**schema, 'x-guidance': _COMPACT})}")
    return f"{rule}_json"


def _call_schema(tool, key: str = "arguments") -> dict:
    parameters = tool.function.parameters or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": tool.function.name},
                                             key: parameters},
            "required": ["name", key], "additionalProperties": False}


def call_events(fmt: str, tools=None):
    """The streaming reader of the format's calls (tool_call_events.py's events); tools: the
    definitions in play (the XML format reads each parameter by its schema)."""
    if fmt == QWEN3_CODER:
        return XmlCallEvents({tool.function.name: (tool.function.parameters or {}).get(
            "properties", {}) for tool in tools or ()})
    if fmt == PYTHONIC:
        return PythonicCallEvents()
    if fmt == LLAMA3_JSON:
        return JsonCallEvents(LLAMA3_JSON_SYNTAX)
    if fmt == MISTRAL:
        return JsonCallEvents(MISTRAL_SYNTAX)
    return ToolCallEvents()


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ParsedReply:
    content: str | None
    tool_calls: list[dict]  # OpenAI's message.tool_calls entries


def parse_reply(text: str, fmt: str = KVRELAY, tools=None) -> ParsedReply:
    """The whole reply: text before the first call is content; each call block becomes a
    tool call (a block that does not parse, e.g. cut by max_tokens, stays in the content)."""
    if fmt in (LLAMA3_JSON, MISTRAL, QWEN3_CODER, PYTHONIC):
        return _parse_event_calls(text, fmt, tools)
    calls = []
    for match in _CALL.finditer(text):
        call = _call_entry(match.group(1))
        if call is None:
            break
        calls.append(call)
    if not calls:
        return ParsedReply(text, [])
    first = text.index(CALL_OPEN)
    content = text[:first].strip() or None
    return ParsedReply(content, calls)


def _parse_event_calls(text: str, fmt: str, tools) -> ParsedReply:
    """The calls of the formats read by a streaming reader; a reply with a call that is not
    whole (cut by max_tokens) keeps all its text as content, with the whole calls before it."""
    parser = call_events(fmt, tools)
    events = parser.feed(text) + parser.finish()
    content = "".join(event.text for event in events if isinstance(event, Content))
    names = {event.index: event.name for event in events if isinstance(event, CallStart)}
    calls = []
    for event in events:
        if not isinstance(event, CallEnd):
            continue
        try:
            arguments = json.loads(event.arguments)
        except ValueError:
            return ParsedReply(text, calls)
        calls.append({"id": new_call_id(), "type": "function",
                      "function": {"name": names[event.index],
                                   "arguments": json.dumps(arguments)}})
    if not calls:
        return ParsedReply(text, [])
    return ParsedReply(content.strip() or None, calls)


def _call_entry(body: str) -> dict | None:
    try:
        parsed = json.loads(body)
        name, arguments = parsed["name"], parsed["arguments"]
    except (ValueError, KeyError, TypeError):
        return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


class ToolCallStream:
    """One choice's streamed text as OpenAI's chat deltas: content as it comes; each tool call's
    id and name once its name is written, then its arguments in pieces as they are generated
    (tool_call_events.py)."""

    def __init__(self, fmt: str = KVRELAY, tools=None) -> None:
        self.events = call_events(fmt, tools)
        self.call_ids: list[str] = []

    @property
    def num_calls(self) -> int:
        return len(self.call_ids)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content to send now, tool-call deltas to send now)."""
        return self._deltas(self.events.feed(text))

    def finish(self) -> tuple[str, list[dict]]:
        """What is left at the end (an unclosed or broken block goes out as content)."""
        return self._deltas(self.events.finish())

    def _deltas(self, events) -> tuple[str, list[dict]]:
        content, calls = "", []
        for event in events:
            if isinstance(event, Content):
                content += event.text
            elif isinstance(event, CallStart):
                self.call_ids.append(new_call_id())
                calls.append({"index": event.index, "id": self.call_ids[-1], "type": "function",
                              "function": {"name": event.name, "arguments": ""}})
            elif isinstance(event, CallArguments):
                calls.append({"index": event.index, "function": {"arguments": event.text}})
        return content, calls
