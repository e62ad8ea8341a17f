"""POST /v1/completions: one or many prompts (text or token ids), n choices each."""
from __future__ import annotations

import asyncio
import time

from starlette.requests import Request
from starlette.responses import JSONResponse

from kvrelay.gateway.errors import GatewayError, invalid
from kvrelay.gateway.openai_logprobs import CompletionLogprobs, joined, prompt_logprobs_json
from kvrelay.gateway.openai_params import completion_params, with_bad_words
from kvrelay.gateway.openai_protocol import CompletionRequest
from kvrelay.gateway.openai_serving import (SSE_DONE, ChunkEncoder, EventStreamResponse,
                                             collect_choices, generation_model, lora_name, sse, sse_error,
                                             unless_disconnected, usage)
from kvrelay.gateway.openai_structured import blame_constraint
from kvrelay.gateway.request_group import RequestGroup


async def create_completion(core, http_request: Request, body: CompletionRequest,
                            client_request_id: str):
    model = await generation_model(core, body.model)
    params = completion_params(body)
    params = await with_bad_words(core, params, body.bad_words, client_request_id)
    prompts = await prompt_token_ids(core, body.prompt, client_request_id)
    core.limits.check_prompt_tokens(prompts)
    echoes = (await _echo_texts(core, body.prompt, prompts, client_request_id)
              if body.echo else None)
    try:
        group = await core.generate(client_request_id, prompts, params, body.priority,
                                   lora_name(core, model))
    except GatewayError as error:
        raise blame_constraint(error, body) from None
    header = {"id": client_request_id, "object": "text_completion", "created": int(time.time()),
              "model": model}
    shape = _Shape(params.logprobs, body.prompt_logprobs, echoes)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        events = _stream(group, header, params.n, shape, include_usage)
        return EventStreamResponse(events, group)
    with group:
        choices = await unless_disconnected(http_request, collect_choices(group, params.n))
        results = []
        for index, choice in enumerate(choices):
            echo = shape.echo(index // params.n)
            offsets = CompletionLogprobs(len(echo))
            result = {"index": index, "text": echo + choice.text,
                      "logprobs": (shape.echoed_logprobs(choice.prompt_logprobs)
                                   if shape.logprobs_of_echo else None)}
            if shape.logprobs is not None:
                steps = offsets.step(choice.logprobs)
                result["logprobs"] = joined(result["logprobs"], steps) \
                    if result["logprobs"] else steps
            if shape.prompt_logprobs is not None:
                result["prompt_logprobs"] = prompt_logprobs_json(choice.prompt_logprobs,
                                                                 shape.prompt_logprobs)
            result.update(finish_reason=choice.finish_reason, stop_reason=choice.stop_reason)
            results.append(result)
        return JSONResponse({**header, "choices": results, "usage": usage(group)})


class _Shape:
    """What a completions response shows beside the text: the sampled tokens' logprobs, the
    prompt's in vLLM's form (prompt_logprobs), and with echo and logprobs the echoed prompt's
    in the logprobs lists."""

    def __init__(self, logprobs: int | None, prompt_logprobs: int | None,
                 echoes: list[str] | None) -> None:
        self.logprobs, self.prompt_logprobs, self.echoes = logprobs, prompt_logprobs, echoes
        self.logprobs_of_echo = echoes is not None and logprobs is not None

    def echo(self, prompt_index: int) -> str:
        return self.echoes[prompt_index] if self.echoes else ""

    def echoed_logprobs(self, entries) -> dict:
        return CompletionLogprobs(0).prompt(entries, self.logprobs)


async def prompt_token_ids(core, prompt, client_request_id: str,
                           param: str = "prompt") -> list[list[int]]:
    """The prompt field (embeddings: input) in its four shapes, as one token id list per
    prompt."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise invalid(f"{param} must not be empty", param)
    if isinstance(prompt[0], int):
        prompt = [prompt]
    prompts = await asyncio.gather(*[_token_ids(core, item, client_request_id)
                                     for item in prompt])
    if not all(prompts):
        raise invalid(f"{param} must not be empty", param)
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


async def _stream(group: RequestGroup, header: dict, n: int, shape: _Shape,
                  include_usage: bool):
    """With echo, each choice's first chunk is its prompt; with echo and logprobs (or
    prompt_logprobs) it waits for the prompt's logprobs, which come with the first token."""
    chunk = dict(header, usage=None) if include_usage else header
    encoder = ChunkEncoder(chunk)
    num_choices = len(group.states) * n
    offsets = [CompletionLogprobs(len(shape.echo(i // n))) for i in range(num_choices)]
    waits_for_prompt = shape.logprobs_of_echo or shape.prompt_logprobs is not None
    if shape.echoes and not waits_for_prompt:
        for index in range(num_choices):
            yield encoder.event({"index": index, "text": shape.echo(index // n),
                                 "logprobs": None, "finish_reason": None})
    async for prompt_index, deltas in group.steps():
        for delta in deltas:
            if delta.finish_reason == "error":
                yield sse_error(delta.error or "generation failed")
                yield SSE_DONE
                return
            index = prompt_index * n + delta.index
            if delta.prompt_logprobs is not None:
                yield encoder.event(_prompt_chunk(index, shape, delta.prompt_logprobs,
                                                  shape.echo(prompt_index)))
            if not (delta.text or delta.finish_reason or delta.logprobs):
                continue
            choice = {"index": index, "text": delta.text, "finish_reason": delta.finish_reason,
                      "logprobs": (offsets[index].step(delta.logprobs or [])
                                   if shape.logprobs is not None else None)}
            if delta.finish_reason is not None:
                choice["stop_reason"] = delta.stop_reason
            yield encoder.event(choice)
    if include_usage:
        yield sse({**chunk, "choices": [], "usage": usage(group)})
    yield SSE_DONE


def _prompt_chunk(index: int, shape: _Shape, entries, echo: str) -> dict:
    """A choice's first chunk where the prompt's logprobs were asked for: the echo (if any),
    its logprobs lists (with echo and logprobs), vLLM's prompt_logprobs (if asked)."""
    choice = {"index": index, "text": echo,
              "logprobs": shape.echoed_logprobs(entries) if shape.logprobs_of_echo
              else None, "finish_reason": None}
    if shape.prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs_json(entries, shape.prompt_logprobs)
    return choice
