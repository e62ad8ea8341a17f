"""Tool calling: the tools' definitions and earlier calls rendered into the prompt, the grammar
that holds the model's calls to the tools' parameter schemas, and the calls read back out of
the text (whole, or as OpenAI's streamed tool-call deltas).

kvrelay's default format, used for every model (the default model's chat template has no tool
support): the tools are listed as JSON, one per line, between <tools> and </tools> in a system
message; the model calls one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>, and
a tool's result comes back as a "tool" message. With tool_choice "required" or a named function
the output is nothing but calls; with "auto" it is either text (which may not start with "<")
or calls, and once a call starts its JSON is held to the schemas.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from services.engine.structured.spec import StructuredOutputs
from services.gateway.errors import invalid

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)
_COMPACT = {"whitespace_flexible": False}  # as for response_format (llguidance_backend.py)

_INSTRUCTIONS = """# Tools
You can call functions to help answer. Their definitions, one JSON object per line:
<tools>
{definitions}
</tools>
To call one, reply with {open}{{"name": "<function name>", "arguments": {{<its arguments>}}}}{close} \
(several such blocks to call several). A function's result comes back in a message from "tool"."""


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


def render_messages(messages, tools, mode: str | None) -> list[dict]:
    """The conversation as the chat template takes it: tools listed in a system message (when
    they are in play), earlier calls as <tool_call> blocks, tool results as "tool" messages."""
    rendered = []
    for message in messages:
        content = message.text()
        if message.tool_calls:
            content += "".join(_call_text(call.function.name, call.function.arguments)
                               for call in message.tool_calls)
        rendered.append({"role": message.role, "content": content})
    if mode is not None:
        definitions = "\n".join(json.dumps(tool.model_dump(by_alias=True, exclude_none=True))
                                for tool in tools)
        instructions = _INSTRUCTIONS.format(definitions=definitions, open=CALL_OPEN,
                                            close=CALL_CLOSE)
        if rendered and rendered[0]["role"] in ("system", "developer"):
            rendered[0] = {**rendered[0], "content": rendered[0]["content"] + "\n\n" +
                           instructions}
        else:
            rendered.insert(0, {"role": "system", "content": instructions})
    return rendered


def _call_text(name: str, arguments: str) -> str:
    try:
        parsed = json.loads(arguments)
    except ValueError:
        raise invalid(f"tool call arguments of {name!r} are not JSON", "messages") from None
    return CALL_OPEN + json.dumps({"name": name, "arguments": parsed}) + CALL_CLOSE


def tool_grammar(tools, mode: str, parallel: bool) -> StructuredOutputs:
    """A Lark grammar (llguidance's, with %json for the call objects) for the mode."""
    chosen = [tool for tool in tools if mode in ("auto", "required") or
              tool.function.name == mode]
    call_schema = {"anyOf": [_call_schema(tool) for tool in chosen], "x-guidance": _COMPACT}
    repeat = "+" if parallel and mode in ("auto", "required") else ""
    rules = [f"calls: call{repeat}",
             f'call: "{CALL_OPEN}" call_json "{CALL_CLOSE}"',
             f"call_json: %json {json.dumps(call_schema)}"]
    if mode == "auto":  # text that cannot open a call, or calls
        start = ["start: TEXT | calls", "TEXT: /(?s:.+)/ & ~/<(?s:.*)/"]
    else:
        start = ["start: calls"]
    return StructuredOutputs("grammar", "\n".join(start + rules))


def _call_schema(tool) -> dict:
    parameters = tool.function.parameters or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": tool.function.name},
                                             "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(slots=True)
class ParsedReply:
    content: str | None
    tool_calls: list[dict]  # OpenAI's message.tool_calls entries


def parse_reply(text: str) -> ParsedReply:
    """The whole reply: text before the first call is content; each call block becomes a
    tool call (a block that does not parse, e.g. cut by max_tokens, stays in the content)."""
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


def _call_entry(body: str) -> dict | None:
    try:
        parsed = json.loads(body)
        name, arguments = parsed["name"], parsed["arguments"]
    except (ValueError, KeyError, TypeError):
        return None
    return {"id": new_call_id(), "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments)}}


@dataclass(slots=True)
class ToolCallStream:
    """One choice's streamed text split into content deltas and whole tool-call deltas (each
    call goes out once its block is closed: id, name and the arguments in one delta)."""
    pending: str = ""  # text not yet classified
    in_calls: bool = False
    num_calls: int = 0
    deltas: list[dict] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """(content to send now, tool-call deltas to send now)."""
        self.pending += text
        content = ""
        if not self.in_calls:
            content, self.pending = self._split_content(self.pending)
        calls = []
        while self.in_calls and CALL_CLOSE in self.pending:
            match = _CALL.search(self.pending)
            if match is None:
                break
            call = _call_entry(match.group(1))
            self.pending = self.pending[match.end():]
            if call is not None:
                calls.append({"index": self.num_calls, **call})
                self.num_calls += 1
        return content, calls

    def finish(self) -> str:
        """Text left over at the end (an unclosed or broken block) goes out as content."""
        rest, self.pending = self.pending, ""
        return rest

    def _split_content(self, text: str) -> tuple[str, str]:
        start = text.find(CALL_OPEN)
        if start >= 0:
            self.in_calls = True
            return text[:start], text[start:]
        # Hold back a tail that may be the start of a call's opening tag.
        for size in range(min(len(CALL_OPEN) - 1, len(text)), 0, -1):
            if CALL_OPEN.startswith(text[-size:]):
                return text[:-size], text[-size:]
        return text, ""
