"""OpenAI request fields to the engine's SamplingParams, with OpenAI's meaning of each field."""
from __future__ import annotations

import dataclasses

from kvrelay.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from kvrelay.engine.structured.spec import StructuredOutputs
from kvrelay.gateway.errors import invalid, param_from_value_error
from kvrelay.gateway.openai_structured import logit_bias, structured_outputs
from kvrelay.gateway.openai_protocol import (ChatCompletionRequest, CompletionRequest,
                                              SamplingFields)

# Request fields passed through as they are unless null (null means the engine's default).
_PASSTHROUGH = ("n", "temperature", "top_p", "top_k", "min_p", "seed", "ignore_eos",
                "min_tokens", "presence_penalty", "frequency_penalty", "repetition_penalty",
                "skip_special_tokens", "allowed_token_ids", "disable_speculation",
                "prompt_logprobs")


async def with_bad_words(core, params: SamplingParams, words: list[str] | None,
                         client_request_id: str) -> SamplingParams:
    """vLLM's bad_words: each word tokenized as written and after a space (how it appears
    mid-sentence), every distinct token sequence banned."""
    if not words:
        return params
    sequences = []
    for word in words:
        for variant in (word.lstrip(), " " + word.lstrip()):
            token_ids = await core.upstream.encode(variant, False, client_request_id)
            if token_ids and token_ids not in sequences:
                sequences.append(token_ids)
    try:
        return dataclasses.replace(params, bad_words_token_ids=sequences)
    except ValueError as exc:
        raise invalid(str(exc), "bad_words") from None


def chat_params(request: ChatCompletionRequest,
                tool_grammar: StructuredOutputs | None = None) -> SamplingParams:
    """tool_grammar: the grammar of the request's tools (openai_tools.py), if they are in play."""
    logprobs = None
    if request.logprobs:
        logprobs = request.top_logprobs or 0
    elif request.top_logprobs is not None:
        raise invalid("top_logprobs needs logprobs set to true", "top_logprobs")
    if logprobs is not None and logprobs > MAX_LOGPROBS:
        raise invalid(f"top_logprobs must be <= {MAX_LOGPROBS}, got {logprobs}", "top_logprobs")
    max_tokens = request.max_completion_tokens
    if max_tokens is None:
        max_tokens = request.max_tokens
    return _sampling_params(request, max_tokens, logprobs, tool_grammar)


def completion_params(request: CompletionRequest) -> SamplingParams:
    if request.suffix is not None:
        raise invalid("suffix is not supported", "suffix")
    # OpenAI's completions default to 16 tokens; chat runs to the end of the context.
    max_tokens = 16 if request.max_tokens is None else request.max_tokens
    params = _sampling_params(request, max_tokens, request.logprobs)
    if request.echo and request.logprobs is not None:  # the echoed prompt's logprobs too
        wanted = max(request.logprobs, params.prompt_logprobs or 0)
        params = dataclasses.replace(params, prompt_logprobs=wanted)
    return params


def _sampling_params(request: SamplingFields, max_tokens: int | None,
                     logprobs: int | None,
                     tool_grammar: StructuredOutputs | None = None) -> SamplingParams:
    if request.stream_options is not None and not request.stream:
        raise invalid("stream_options is only allowed with stream set to true", "stream_options")
    values = {name: value for name in _PASSTHROUGH
              if (value := getattr(request, name)) is not None}
    stop = request.stop
    values["stop"] = [stop] if isinstance(stop, str) else list(stop or [])
    values["stop_token_ids"] = list(request.stop_token_ids or [])
    values["max_tokens"] = max_tokens
    values["logprobs"] = logprobs
    values["structured_outputs"] = structured_outputs(request)
    if tool_grammar is not None:
        if values["structured_outputs"] is not None:
            raise invalid("tools (unless tool_choice is none) cannot be combined with another "
                          "output constraint", "tools")
        values["structured_outputs"] = tool_grammar
    values["logit_bias"] = logit_bias(request)
    try:
        return SamplingParams.from_dict(values)
    except ValueError as exc:
        raise param_from_value_error(exc) from None
