"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API for text, on
the same path as chat (the model's chat template, the tool grammar, structured output)."""
from __future__ import annotations

import json
import time

from starlette.requests import Request
from starlette.responses import JSONResponse

from kvrelay.engine.sampling_params import SamplingParams
from kvrelay.engine.structured.spec import StructuredOutputs
from kvrelay.gateway.errors import GatewayError, invalid, param_from_value_error
from kvrelay.gateway.openai_protocol import NamedToolChoice, Tool
from kvrelay.gateway.openai_serving import (EventStreamResponse, collect_choices,
                                             generation_model, lora_name, unless_disconnected)
from kvrelay.gateway.openai_structured import blame_compile_error
from kvrelay.gateway.openai_tools import tool_choice_mode, tool_grammar, tools_in_play
from kvrelay.gateway.reasoning import with_reasoning
from kvrelay.gateway.request_group import RequestGroup
from kvrelay.gateway.responses_input import (input_messages, output_messages,
                                              prior_conversation, with_instructions)
from kvrelay.gateway.responses_output import ResponseBuilder, new_id
from kvrelay.gateway.responses_protocol import ResponsesRequest
from kvrelay.gateway.responses_store import ResponseStore

# SamplingParams' names for the fields it checks -> the Responses API's, where they differ
_PARAMS = {"max_tokens": "max_output_tokens"}


async def create_response(core, store: ResponseStore, http_request: Request,
                          body: ResponsesRequest, client_request_id: str):
    model = await generation_model(core, body.model)
    keep = _keeps(body, store)
    conversation = prior_conversation(body, store) + input_messages(body)
    tools = _chat_tools(body)
    tool_choice = body.tool_choice
    if tool_choice is not None and not isinstance(tool_choice, str):
        tool_choice = NamedToolChoice(type="function", function={"name": tool_choice.name})
    mode = tool_choice_mode(tools, tool_choice)
    effort = body.reasoning.effort if body.reasoning is not None else None
    try:
        prompt, call_format = await core.upstream.render_chat_with_tools(
            with_instructions(body, conversation), True, client_request_id,
            tools_in_play(tools, mode), effort)
    except GatewayError as error:
        if error.param == "reasoning_effort":
            error.param = "reasoning"
        raise
    core.limits.check_prompt_tokens([prompt], "input")
    grammar = tool_grammar(tools, mode, body.parallel_tool_calls, call_format) \
        if mode is not None else None
    params = _params(body, grammar)
    # inside: None without a reasoning parser, else whether the reply starts in reasoning
    params, inside = await with_reasoning(core, prompt, params, client_request_id)
    try:
        group = await core.generate(client_request_id, [prompt], params,
                                   lora_name=lora_name(core, model))
    except GatewayError as error:
        raise blame_compile_error(error, "tools" if grammar is not None else "text") from None
    builder = ResponseBuilder(_fields(body, model, keep),
                              call_format if mode is not None else None, inside, tools)
    on_done = _storer(store, conversation) if keep else None
    if body.stream:
        return EventStreamResponse(_stream(group, builder, on_done), group)
    with group:
        choice, = await unless_disconnected(http_request, collect_choices(group, 1))
    for text, num_tokens in zip(choice.texts, choice.num_tokens):
        builder.feed(text, num_tokens)
    _, response = builder.finish(choice.finish_reason, _usage(group))
    if on_done is not None:
        on_done(response)
    return JSONResponse(response)


def get_response(store: ResponseStore, response_id: str) -> JSONResponse:
    stored = store.get(response_id)
    if stored is None:
        raise GatewayError("not_found", f"no stored response {response_id!r}", "response_id")
    return JSONResponse(stored.body)


def delete_response(store: ResponseStore, response_id: str) -> JSONResponse:
    if not store.delete(response_id):
        raise GatewayError("not_found", f"no stored response {response_id!r}", "response_id")
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _keeps(body: ResponsesRequest, store: ResponseStore) -> bool:
    """store=true needs a store; unset means keep where this gateway keeps responses."""
    if body.store and not store.enabled:
        raise invalid("store: this server keeps no responses (--responses-store-bytes 0); "
                      "send store=false", "store")
    if body.previous_response_id is not None and not store.enabled:
        raise invalid("previous_response_id: this server keeps no responses "
                      "(--responses-store-bytes 0)", "previous_response_id")
    return store.enabled if body.store is None else body.store


def _chat_tools(body: ResponsesRequest) -> list[Tool] | None:
    if not body.tools:
        return None
    return [Tool(type="function", function=tool.model_dump(exclude={"type"}, exclude_none=True))
            for tool in body.tools]


def _params(body: ResponsesRequest, grammar: StructuredOutputs | None) -> SamplingParams:
    values = {"max_tokens": body.max_output_tokens, "structured_outputs": _text_format(body)}
    for name in ("temperature", "top_p"):
        if getattr(body, name) is not None:
            values[name] = getattr(body, name)
    if grammar is not None:
        if values["structured_outputs"] is not None:
            raise invalid("tools (unless tool_choice is none) cannot be combined with a JSON "
                          "text.format", "tools")
        values["structured_outputs"] = grammar
    try:
        return SamplingParams.from_dict(values)
    except ValueError as exc:
        error = param_from_value_error(exc)
        error.param = _PARAMS.get(error.param, error.param)
        raise error from None


def _text_format(body: ResponsesRequest) -> StructuredOutputs | None:
    text_format = body.text.format if body.text is not None else None
    if text_format is None or text_format.type == "text":
        return None
    if text_format.type == "json_object":
        return StructuredOutputs("json_object")
    if text_format.schema_ is None:
        raise invalid("text.format json_schema needs a schema", "text")
    try:
        return StructuredOutputs.json_schema(text_format.schema_)
    except ValueError as exc:
        raise invalid(f"text: {exc}", "text") from None


def _fields(body: ResponsesRequest, model: str, keep: bool) -> dict:
    """The response object's fields that echo the request (OpenAI's defaults where unset)."""
    text_format = body.text.format if body.text is not None else None
    return {
        "id": new_id("resp"), "created_at": int(time.time()), "model": model,
        "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
        "metadata": body.metadata or {}, "parallel_tool_calls": body.parallel_tool_calls,
        "previous_response_id": body.previous_response_id, "store": keep,
        "reasoning": body.reasoning.model_dump() if body.reasoning is not None else None,
        "temperature": 1.0 if body.temperature is None else body.temperature,
        "top_p": 1.0 if body.top_p is None else body.top_p,
        "text": {"format": text_format.model_dump(by_alias=True, exclude_none=True)
                 if text_format is not None else {"type": "text"}},
        "tool_choice": _echo_tool_choice(body), "truncation": "disabled",
        "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or ()],
        "user": body.user}


def _echo_tool_choice(body: ResponsesRequest):
    if body.tool_choice is None:
        return "auto"
    if isinstance(body.tool_choice, str):
        return body.tool_choice
    return body.tool_choice.model_dump()


def _usage(group: RequestGroup) -> dict:
    prompt_tokens, output_tokens = group.num_prompt_tokens, group.num_output_tokens
    return {"input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": group.num_cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens}


def _storer(store: ResponseStore, conversation: list[dict]):
    def keep(response: dict) -> None:
        store.put(response["id"], response,
                  conversation + output_messages(response["output"]))
    return keep


def _sse(event: dict) -> bytes:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n".encode()


async def _stream(group: RequestGroup, builder: ResponseBuilder, on_done):
    for event in builder.start():
        yield _sse(event)
    async for _, deltas in group.steps():
        for delta in deltas:
            if delta.finish_reason == "error":
                yield _sse(builder.failed(delta.error or "generation failed"))
                return
            for event in builder.feed(delta.text, len(delta.token_ids)):
                yield _sse(event)
            if delta.finish_reason is not None:
                events, response = builder.finish(delta.finish_reason, _usage(group))
                if on_done is not None:
                    on_done(response)
                for event in events:
                    yield _sse(event)
