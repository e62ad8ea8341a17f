"""A Responses request's conversation as the tokenizer renders it (the dicts of
openai_tools.chat_messages): the instructions as a system message, then the stored conversation
of previous_response_id, then the request's own input items, and the output items of a finished
response turned back into messages for the next turn."""
from __future__ import annotations

from kvrelay.gateway.errors import GatewayError
from kvrelay.gateway.openai_tools import parsed_arguments
from kvrelay.gateway.responses_protocol import (FunctionCallItem, FunctionCallOutputItem,
                                                 MessageItem, ResponsesRequest)
from kvrelay.gateway.responses_store import ResponseStore

_ROLES = {"developer": "system"}  # templates know system; OpenAI's developer is the same


def prior_conversation(body: ResponsesRequest, store: ResponseStore) -> list[dict]:
    """What previous_response_id continues (empty without one); a 404 for an unknown id."""
    if body.previous_response_id is None:
        return []
    stored = store.get(body.previous_response_id)
    if stored is None:
        raise GatewayError("not_found", f"no stored response {body.previous_response_id!r} "
                           "(never stored, expired, deleted, or kept by another gateway)",
                           "previous_response_id")
    return list(stored.conversation)


def input_messages(body: ResponsesRequest) -> list[dict]:
    """The request's input items as messages: consecutive function calls (and the assistant text
    before them) make one assistant message, as a chat reply carries them."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict] = []
    for item in body.input:
        if isinstance(item, MessageItem):
            messages.append({"role": _ROLES.get(item.role, item.role), "content": item.text()})
        elif isinstance(item, FunctionCallItem):
            _add_call(messages, item.name,
                      parsed_arguments(item.name, item.arguments, "input"))
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "content": item.text(),
                             "tool_call_id": item.call_id})
        # a ReasoningItem is not rendered: thinking models' templates drop earlier reasoning
    return messages


def with_instructions(body: ResponsesRequest, conversation: list[dict]) -> list[dict]:
    if body.instructions is None:
        return conversation
    return [{"role": "system", "content": body.instructions}, *conversation]


def output_messages(output: list[dict]) -> list[dict]:
    """A response's output items as the assistant's turn (its reasoning left out, as the
    templates of thinking models leave out earlier turns' reasoning)."""
    messages: list[dict] = []
    for item in output:
        if item["type"] == "message":
            text = "".join(part["text"] for part in item["content"])
            messages.append({"role": "assistant", "content": text})
        elif item["type"] == "function_call":
            _add_call(messages, item["name"],
                      parsed_arguments(item["name"], item["arguments"], "previous_response_id"))
    return messages


def _add_call(messages: list[dict], name: str, arguments: dict) -> None:
    call = {"name": name, "arguments": arguments}  # ids are not rendered
    last = messages[-1] if messages else None
    if last is not None and last["role"] == "assistant":
        last.setdefault("tool_calls", []).append(call)
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
