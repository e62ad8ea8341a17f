"""POST /v1/chat/completions."""
from __future__ import annotations

import dataclasses
import time

from starlette.requests import Request
from starlette.responses import JSONResponse

from kvrelay.gateway.errors import GatewayError
from kvrelay.gateway.openai_logprobs import chat_logprobs, prompt_logprobs_json
from kvrelay.gateway.openai_params import chat_params, with_bad_words
from kvrelay.gateway.openai_protocol import ChatCompletionRequest
from kvrelay.gateway.openai_serving import (SSE_DONE, ChunkEncoder, EventStreamResponse,
                                             collect_choices, generation_model, lora_name, sse, sse_error,
                                             unless_disconnected, usage)
from kvrelay.gateway.openai_structured import blame_constraint
from kvrelay.gateway.openai_tools import (ToolCallStream, chat_messages, parse_reply,
                                           tool_choice_mode, tool_grammar, tools_in_play)
from kvrelay.gateway.reasoning import ReasoningSplit, split_whole, with_reasoning
from kvrelay.gateway.request_group import RequestGroup


async def create_chat_completion(core, http_request: Request, body: ChatCompletionRequest,
                                 client_request_id: str):
    model = await generation_model(core, body.model)
    tools_mode = tool_choice_mode(body.tools, body.tool_choice)
    prompt, call_format = await core.upstream.render_chat_with_tools(
        chat_messages(body.messages), body.add_generation_prompt, client_request_id,
        tools_in_play(body.tools, tools_mode), body.reasoning_effort)
    core.limits.check_prompt_tokens([prompt], "messages")
    grammar = tool_grammar(body.tools, tools_mode, body.parallel_tool_calls, call_format) \
        if tools_mode is not None else None
    params = chat_params(body, grammar)
    params = await with_bad_words(core, params, body.bad_words, client_request_id)
    # inside: None without a reasoning parser, else whether the reply starts in reasoning
    params, inside = await with_reasoning(core, prompt, params, client_request_id)
    try:
        group = await core.generate(client_request_id, [prompt], params, body.priority,
                                   lora_name(core, model))
    except GatewayError as error:
        raise blame_constraint(error, body, from_tools=grammar is not None) from None
    header = {"id": client_request_id, "created": int(time.time()), "model": model}
    tools_format = call_format if tools_mode is not None else None  # how calls are read
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStreamResponse(_stream(group, header, params.n, include_usage, tools_format,
                                           inside, params.prompt_logprobs, body.tools), group)
    with group:
        choices = await unless_disconnected(http_request, collect_choices(group, params.n))
        return JSONResponse({**header, "object": "chat.completion", "choices": [
            {"index": index, **_message_and_reason(choice, tools_format, inside, body.tools),
             "logprobs": ({"content": chat_logprobs(choice.logprobs)}
                          if params.logprobs is not None else None),
             "stop_reason": choice.stop_reason}
            for index, choice in enumerate(choices)], "usage": usage(group),
            **_prompt_logprobs(choices[0].prompt_logprobs, params.prompt_logprobs)})


def _prompt_logprobs(entries, num_top: int | None) -> dict:
    """vLLM's top-level prompt_logprobs, where asked."""
    return {} if num_top is None else {"prompt_logprobs": prompt_logprobs_json(entries, num_top)}


def _message_and_reason(choice, tools_format: str | None, inside: bool | None,
                        tools=None) -> dict:
    """tools_format: how the reply writes calls (None: no tools in play); inside: None without
    a reasoning parser, else whether the reply starts in reasoning."""
    text, reasoning = choice.text, None
    if inside is not None:
        reasoning, text = split_whole(text, inside)
    if tools_format is None:
        message = {"role": "assistant", "content": text}
        if inside is not None:
            message["reasoning_content"] = reasoning
        return {"message": message, "finish_reason": choice.finish_reason}
    reply = parse_reply(text, tools_format, tools)
    message = {"role": "assistant", "content": reply.content}
    if inside is not None:
        message["reasoning_content"] = reasoning
    if reply.tool_calls:
        message["tool_calls"] = reply.tool_calls
    return {"message": message, "finish_reason": _tools_reason(choice.finish_reason,
                                                               bool(reply.tool_calls))}


def _tools_reason(finish_reason: str | None, called: bool) -> str | None:
    """A reply that ended by itself after calling tools ends with "tool_calls", as OpenAI's."""
    return "tool_calls" if called and finish_reason == "stop" else finish_reason


async def _stream(group: RequestGroup, header: dict, n: int, include_usage: bool,
                  tools_format: str | None = None, inside: bool | None = None,
                  num_prompt_top: int | None = None, tools=None):
    """SSE chunks: a role delta per choice, one chunk per choice and step, usage, [DONE].
    With a reasoning parser (inside not None) each choice's text is split first: reasoning
    goes out as reasoning_content deltas. With tools, the rest goes through a ToolCallStream:
    content as it comes, each tool call's name once written, then its arguments in pieces.
    Where prompt logprobs are asked for, a chunk without choices carries them when they come
    (with the first token)."""
    chunk = {**header, "object": "chat.completion.chunk"}
    if include_usage:
        chunk["usage"] = None
    encoder = ChunkEncoder(chunk)
    for index in range(n):
        yield encoder.event({"index": index, "logprobs": None, "finish_reason": None,
                             "delta": {"role": "assistant", "content": ""}})
    tool_streams = {index: ToolCallStream(tools_format, tools) for index in range(n)} \
        if tools_format is not None else None
    splits = {index: ReasoningSplit(inside) for index in range(n)} if inside is not None else None
    async for _, deltas in group.steps():
        for delta in deltas:
            if delta.finish_reason == "error":
                yield sse_error(delta.error or "generation failed")
                yield SSE_DONE
                return
            if delta.prompt_logprobs is not None and delta.index == 0:
                yield sse({**chunk, "choices": [],
                           **_prompt_logprobs(delta.prompt_logprobs, num_prompt_top)})
            if splits is not None:
                reasoning, delta = _split_reasoning(delta, splits[delta.index])
                if reasoning:
                    yield encoder.event({"index": delta.index, "logprobs": None,
                                         "finish_reason": None,
                                         "delta": {"reasoning_content": reasoning}})
            if tool_streams is not None:
                choice = _tool_chunk(delta, tool_streams[delta.index])
                if choice is not None:
                    yield encoder.event(choice)
            elif delta.text or delta.finish_reason or delta.logprobs:
                yield encoder.event(_choice_chunk(delta))
    if include_usage:
        yield sse({**chunk, "choices": [], "usage": usage(group)})
    yield SSE_DONE


def _split_reasoning(delta, split: ReasoningSplit):
    """(the delta's reasoning text, the delta with only its answer text)."""
    reasoning, content = split.feed(delta.text)
    if delta.finish_reason is not None:
        rest_reasoning, rest_content = split.finish()
        reasoning, content = reasoning + rest_reasoning, content + rest_content
    return reasoning, dataclasses.replace(delta, text=content)


def _choice_chunk(delta) -> dict:
    choice = {"index": delta.index, "delta": {"content": delta.text} if delta.text else {},
              "logprobs": {"content": chat_logprobs(delta.logprobs)} if delta.logprobs else None,
              "finish_reason": delta.finish_reason}
    if delta.finish_reason is not None:
        choice["stop_reason"] = delta.stop_reason
    return choice


def _tool_chunk(delta, stream: ToolCallStream) -> dict | None:
    """The choice chunk for this delta, or None while its text is held back."""
    content, calls = stream.feed(delta.text)
    finish_reason = delta.finish_reason
    if finish_reason is not None:
        rest, last_calls = stream.finish()
        content, calls = content + rest, calls + last_calls
        finish_reason = _tools_reason(finish_reason, stream.num_calls > 0)
    body = {"content": content} if content else {}
    if calls:
        body["tool_calls"] = calls
    if not body and finish_reason is None and not delta.logprobs:
        return None
    choice = {"index": delta.index, "delta": body,
              "logprobs": {"content": chat_logprobs(delta.logprobs)} if delta.logprobs else None,
              "finish_reason": finish_reason}
    if finish_reason is not None:
        choice["stop_reason"] = delta.stop_reason
    return choice
