"""POST /v1/completions: one or many prompts (text or token ids), n choices each."""
from __future__ import annotations

import asyncio
import time

from starlette.requests import Request
from starlette.responses import JSONResponse

from kvrelay.gateway.errors import GatewayError, invalid
from kvrelay.gateway.openai_logprobs import CompletionLogprobs
from kvrelay.gateway.openai_params import completion_params, with_bad_words
from kvrelay.gateway.openai_protocol import CompletionRequest
from kvrelay.gateway.openai_serving import (SSE_DONE, ChunkEncoder, EventStreamResponse,
                                             collect_choices, generation_model, sse, sse_error,
                                             unless_disconnected, usage)
from kvrelay.gateway.openai_structured import blame_constraint
from kvrelay.gateway.request_group import RequestGroup


async def create_completion(core, http_request: Request, body: CompletionRequest,
                            client_request_id: str):
    model = await generation_model(core, body.model)
    params = completion_params(body)
    params = await with_bad_words(core, params, body.bad_words, client_request_id)
    prompts = await _prompt_token_ids(core, body.prompt, client_request_id)
    core.limits.check_prompt_tokens(prompts)
    echoes = (await _echo_texts(core, body.prompt, prompts, client_request_id)
              if body.echo else None)
    try:
        group = await core.generate(client_request_id, prompts, params, body.priority)
    except GatewayError as error:
        raise blame_constraint(error, body) from None
    header = {"id": client_request_id, "object": "text_completion", "created": int(time.time()),
              "model": model}
    want_logprobs = params.logprobs is not None
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _stream(group, header, params.n, echoes, want_logprobs, include_usage)
        return EventStreamResponse(events, group)
    with group:
        choices = await unless_disconnected(http_request, collect_choices(group, params.n))
        results = []
        for index, choice in enumerate(choices):
            echo = echoes[index // params.n] if echoes else ""
            logprobs = (CompletionLogprobs(len(echo)).step(choice.logprobs)
                        if want_logprobs else None)
            results.append({"index": index, "text": echo + choice.text, "logprobs": logprobs,
                            "finish_reason": choice.finish_reason,
                            "stop_reason": choice.stop_reason})
        return JSONResponse({**header, "choices": results, "usage": usage(group)})


async def _prompt_token_ids(core, prompt, client_request_id: str) -> list[list[int]]:
    """The prompt field in its four shapes, as one token id list per prompt."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise invalid("prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    prompts = await asyncio.gather(*[_token_ids(core, item, client_request_id)
                                     for item in prompt])
    if not all(prompts):
        raise invalid("prompt must not be empty", "prompt")
    return prompts


async def _token_ids(core, prompt: str | list[int], client_request_id: str) -> list[int]:
    if isinstance(prompt, str):
        return await core.upstream.encode(prompt, True, client_request_id)
    return list(prompt)


async def _echo_texts(core, prompt, prompts: list[list[int]],
                      client_request_id: str) -> list[str]:
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], str):
        return list(prompt)
    return [await core.upstream.decode(ids, client_request_id, skip_special_tokens=False)
            for ids in prompts]


async def _stream(group: RequestGroup, header: dict, n: int, echoes: list[str] | None,
                  want_logprobs: bool, include_usage: bool):
    chunk = dict(header, usage=None) if include_usage else header
    encoder = ChunkEncoder(chunk)
    offsets = [CompletionLogprobs(len(echoes[i // n]) if echoes else 0)
               for i in range(len(group.states) * n)]
    if echoes:
        for index in range(len(offsets)):
            yield encoder.event({"index": index, "text": echoes[index // n], "logprobs": None,
                                 "finish_reason": None})
    async for prompt_index, deltas in group.steps():
        for delta in deltas:
            if delta.finish_reason == "error":
                yield sse_error(delta.error or "generation failed")
                yield SSE_DONE
                return
            if not (delta.text or delta.finish_reason or delta.logprobs):
                continue
            index = prompt_index * n + delta.index
            choice = {"index": index, "text": delta.text, "finish_reason": delta.finish_reason,
                      "logprobs": (offsets[index].step(delta.logprobs or [])
                                   if want_logprobs else None)}
            if delta.finish_reason is not None:
                choice["stop_reason"] = delta.stop_reason
            yield encoder.event(choice)
    if include_usage:
        yield sse({**chunk, "choices": [], "usage": usage(group)})
    yield SSE_DONE
