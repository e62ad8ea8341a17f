"""Tool calling's way into the chat template: OpenAI's tool definitions, the calls of earlier
assistant turns and the tools' results.

Where the model's template renders `tools` itself and writes calls as Hermes-style
<tool_call> blocks (Qwen2.5, Hermes and the many templates built on theirs), the conversation
goes to the template as it is (`hermes`): the tool definitions as apply_chat_template's `tools`,
each earlier call as a `tool_calls` entry with its arguments as an object, each result as a
"tool" message with its `tool_call_id`. The model then calls a tool as
<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>, as its template taught it.

Other templates (the default model's has no tool support) get kvrelay's default format
(`kvrelay`): the tools listed as JSON, one per line, between <tools> and </tools> in a system
message; earlier calls written into the assistant's text as <tool_call>{...}</tool_call>;
results as "tool" messages. The gateway's grammar and parser follow the format the tokenizer
reports (services/gateway/openai_tools.py).

Torch-free: the tokenizer service imports it.
"""
from __future__ import annotations

import json
import re

KVRELAY, HERMES = "kvrelay", "hermes"
# vLLM's --tool-call-parser names
LLAMA3_JSON, MISTRAL, QWEN3_CODER, PYTHONIC = "llama3_json", "mistral", "qwen3_coder", "pythonic"
FORMATS = (KVRELAY, HERMES, LLAMA3_JSON, MISTRAL, QWEN3_CODER, PYTHONIC)
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"

_INSTRUCTIONS = """# Tools
You can call functions to help answer. Their definitions, one JSON object per line:
<tools>
{definitions}
</tools>
To call one, reply with {open}{{"name": "<function name>", "arguments": {{<its arguments>}}}}{close} \
(several such blocks to call several). A function's result comes back in a message from "tool"."""

# A template that reads the `tools` variable (not a word inside some other name).
_USES_TOOLS = re.compile(r"\btools\b")


def tool_call_format(chat_template: str | None, chosen: str = "auto") -> str:
    """The format the template teaches, where it renders the tools itself: MISTRAL
    ([TOOL_CALLS] and a JSON list), LLAMA3_JSON (a bare {"name", "parameters"} object, as Llama
    3.1-3.3's templates teach beside <|python_tag|>), QWEN3_CODER (<function=...> and
    <parameter=...> tags), PYTHONIC ([func_name1(params_name1=...), ...], as Llama 3.2's
    pythonic template writes it), HERMES (<tool_call> blocks of JSON); else KVRELAY.
    chosen: the tokenizer's --tool-call-parser, "auto" to read the template."""
    if chosen != "auto":
        return chosen
    if not chat_template or not _USES_TOOLS.search(chat_template):
        return KVRELAY
    if "[TOOL_CALLS]" in chat_template:
        return MISTRAL
    if "<function=" in chat_template:
        return QWEN3_CODER
    if "func_name1(" in chat_template:
        return PYTHONIC
    if '"parameters"' in chat_template and ("<|python_tag|>" in chat_template
                                            or "ipython" in chat_template):
        return LLAMA3_JSON
    if CALL_OPEN in chat_template:
        return HERMES
    return KVRELAY


def parse_tool_calls(tool_calls_json: str) -> list[dict]:
    """A message's calls as the gateway sends them: a JSON list of {"name", "arguments"} with
    the arguments an object. Raises ValueError otherwise."""
    try:
        calls = json.loads(tool_calls_json)
    except ValueError:
        raise ValueError("tool_calls_json is not JSON") from None
    if not isinstance(calls, list) or not all(
            isinstance(call, dict) and isinstance(call.get("name"), str)
            and isinstance(call.get("arguments"), dict) for call in calls):
        raise ValueError('tool_calls_json must be a list of {"name": str, "arguments": object}')
    return calls


def parse_tools(tools_json: str) -> list[dict] | None:
    """The tool definitions in play (OpenAI's form), or None for none. Raises ValueError."""
    if not tools_json:
        return None
    try:
        tools = json.loads(tools_json)
    except ValueError:
        raise ValueError("tools_json is not JSON") from None
    if not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools):
        raise ValueError("tools_json must be a list of tool definitions")
    return tools or None


def template_inputs(messages: list[dict], tools: list[dict] | None,
                    fmt: str) -> tuple[list[dict], list[dict] | None]:
    """messages: role and content, and where present tool_calls ([{"name", "arguments"}]),
    tool_call_id and name. Returns the conversation and the `tools` argument for the template."""
    if fmt != KVRELAY:  # the template renders tools, calls and results itself
        return [_native_message(message) for message in messages], tools
    return _kvrelay_messages(messages, tools), None


def _native_message(message: dict) -> dict:
    rendered = {"role": message["role"], "content": message["content"]}
    if message.get("tool_calls"):
        rendered["tool_calls"] = [
            {"type": "function", "function": {"name": call["name"], "arguments": call["arguments"]}}
            for call in message["tool_calls"]]
    for key in ("tool_call_id", "name"):
        if message.get(key):
            rendered[key] = message[key]
    return rendered


def _kvrelay_messages(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    rendered = []
    for message in messages:
        content = message["content"] + "".join(
            call_text(call["name"], call["arguments"]) for call in message.get("tool_calls") or ())
        rendered.append({"role": message["role"], "content": content})
    if tools:
        definitions = "\n".join(json.dumps(tool) for tool in tools)
        instructions = _INSTRUCTIONS.format(definitions=definitions, open=CALL_OPEN,
                                            close=CALL_CLOSE)
        if rendered and rendered[0]["role"] in ("system", "developer"):
            rendered[0] = {**rendered[0], "content": rendered[0]["content"] + "\n\n" +
                           instructions}
        else:
            rendered.insert(0, {"role": "system", "content": instructions})
    return rendered


def call_text(name: str, arguments: dict) -> str:
    return CALL_OPEN + json.dumps({"name": name, "arguments": arguments}) + CALL_CLOSE
