"""The REST side of limits.py: the body read under its size limit, text that is not UTF-8 named
by its field, and each OpenAI body's fields held to the limits before anything is tokenized."""
from __future__ import annotations

import json

from pydantic import BaseModel
from starlette.requests import Request

from kvrelay.gateway.limits import RequestLimits
from kvrelay.gateway.openai_protocol import (ChatCompletionRequest, CompletionRequest,
                                              EmbeddingRequest, SamplingFields)
from kvrelay.gateway.text_fields import json_texts

async def read_body(request: Request, limits: RequestLimits) -> bytes:
    """The body, refused (413) as soon as it is known to be too large: by its Content-Length
    before any of it is read, or, sent chunked, once what has arrived passes the limit."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit():
        limits.check_body_size(int(declared))
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        limits.check_body_size(size)
        chunks.append(chunk)
    return b"".join(chunks)


def check_unparsed_text(raw: bytes, errors: list[dict], limits: RequestLimits) -> None:
    """pydantic's JSON parser refuses bytes that are not UTF-8 and lone surrogate escapes with a
    line and column only. For such a body, raise the error that names the field: decoded with
    surrogateescape, the bad bytes become surrogates that the text check finds. Does nothing
    for other bodies (raw C0 control characters in a string, which JSON forbids, keep
    pydantic's invalid-JSON error), or when the body is not JSON anyway."""
    if not any(error.get("type") == "json_invalid" for error in errors):
        return
    try:
        value = json.loads(raw.decode("utf-8", "surrogateescape"), strict=False)
    except (ValueError, RecursionError):  # not JSON either: pydantic's message says where
        return
    try:
        limits.check_texts(json_texts(value))
    except RecursionError:
        return


def check_body_limits(body: BaseModel, raw: bytes, limits: RequestLimits) -> None:
    """Every limit a parsed body's own fields must meet (the prompt's tokens are counted once
    tokenized, by the endpoint)."""
    # A parsed body's strings are valid UTF-8 (pydantic refused the rest), so only their
    # length can be over; JSON text is never more characters than bytes.
    if len(raw) > limits.max_request_text_chars:
        limits.check_texts(json_texts(body))
    messages = getattr(body, "messages", None)
    if messages is not None:
        limits.check_messages(len(messages))
    items = getattr(body, "input", None)  # /v1/responses: a text or a list of items
    if isinstance(items, list):
        limits.check_messages(len(items), "input")
    if isinstance(body, SamplingFields):
        limits.check_n(body.n)
        limits.check_stop([body.stop] if isinstance(body.stop, str) else body.stop or [])
    if isinstance(body, SamplingFields):
        limits.check_logprobs(body.prompt_logprobs, "prompt_logprobs")
    if isinstance(body, ChatCompletionRequest):
        limits.check_logprobs(body.top_logprobs, "top_logprobs")
    if isinstance(body, CompletionRequest):
        limits.check_logprobs(body.logprobs)
        limits.check_prompts(num_prompts(body.prompt))
    if isinstance(body, EmbeddingRequest):
        limits.check_prompts(num_prompts(body.input), "input")


def num_prompts(prompt: str | list) -> int:
    """The prompt field's four shapes: a text, texts, token ids, lists of token ids."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return 1
    return len(prompt)
