"""POST /v1/chat/completions."""
from __future__ import annotations

import time

from starlette.requests import Request
from starlette.responses import JSONResponse

from services.gateway.errors import GatewayError
from services.gateway.openai_logprobs import chat_logprobs
from services.gateway.openai_params import chat_params
from services.gateway.openai_protocol import ChatCompletionRequest
from services.gateway.openai_serving import (SSE_DONE, ChunkEncoder, EventStreamResponse,
                                             collect_choices, served_model, sse, sse_error,
                                             unless_disconnected, usage)
from services.gateway.openai_structured import blame_constraint
from services.gateway.request_group import RequestGroup


async def create_chat_completion(core, http_request: Request, body: ChatCompletionRequest,
                                 request_id: str):
    model = served_model(core, body.model)
    params = chat_params(body)
    messages = [{"role": message.role, "content": message.text()} for message in body.messages]
    prompt = await core.upstream.render_chat(messages, body.add_generation_prompt, request_id)
    try:
        group = await core.generate(request_id, [prompt], params, body.priority)
    except GatewayError as error:
        raise blame_constraint(error, body) from None
    header = {"id": request_id, "created": int(time.time()), "model": model}
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return EventStreamResponse(_stream(group, header, params.n, include_usage), group)
    with group:
        choices = await unless_disconnected(http_request, collect_choices(group, params.n))
        return JSONResponse({**header, "object": "chat.completion", "choices": [
            {"index": index, "message": {"role": "assistant", "content": choice.text},
             "logprobs": ({"content": chat_logprobs(choice.logprobs)}
                          if params.logprobs is not None else None),
             "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}
            for index, choice in enumerate(choices)], "usage": usage(group)})


async def _stream(group: RequestGroup, header: dict, n: int, include_usage: bool):
    """SSE chunks: a role delta per choice, one chunk per choice and step, usage, [DONE]."""
    chunk = {**header, "object": "chat.completion.chunk"}
    if include_usage:
        chunk["usage"] = None
    encoder = ChunkEncoder(chunk)
    for index in range(n):
        yield encoder.event({"index": index, "logprobs": None, "finish_reason": None,
                             "delta": {"role": "assistant", "content": ""}})
    async for _, deltas in group.steps():
        for delta in deltas:
            if delta.finish_reason == "error":
                yield sse_error(delta.error or "generation failed")
                yield SSE_DONE
                return
            if delta.text or delta.finish_reason or delta.logprobs:
                yield encoder.event(_choice_chunk(delta))
    if include_usage:
        yield sse({**chunk, "choices": [], "usage": usage(group)})
    yield SSE_DONE


def _choice_chunk(delta) -> dict:
    choice = {"index": delta.index, "delta": {"content": delta.text} if delta.text else {},
              "logprobs": {"content": chat_logprobs(delta.logprobs)} if delta.logprobs else None,
              "finish_reason": delta.finish_reason}
    if delta.finish_reason is not None:
        choice["stop_reason"] = delta.stop_reason
    return choice
