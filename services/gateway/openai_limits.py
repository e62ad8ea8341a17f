"""The REST side of limits.py: the body read under its size limit, text that is not UTF-8 named
by its field, and each OpenAI body's fields held to the limits before anything is tokenized."""
from __future__ import annotations

import json
import re

from pydantic import BaseModel
from starlette.requests import Request

from kvrelay.gateway.limits import RequestLimits
from kvrelay.gateway.openai_protocol import (ChatCompletionRequest, CompletionRequest,
                                              SamplingFields)
from kvrelay.gateway.text_fields import json_texts

# What a control character looks like in a JSON body: a raw byte (DEL; C0, which JSON forbids
# unescaped in strings), C1 in UTF-8 (\xc2\x80-\xc2\x9f) or an escape (\u0001). A body without
# any, no longer in bytes than the text limit in characters (JSON text is never more characters
# than bytes), cannot fail the text checks, so its strings are not walked: the scans below cost
# a few microseconds for a small chat body, the walk a hundred.
_CONTROL_BYTES = bytes([*range(0x00, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), 0x7F])
_C1_IN_UTF8 = re.compile(rb"\xc2[\x80-\x9f]")
_CONTROL_ESCAPE = re.compile(rb"\\u00[0189][0-9a-fA-F]|\\u007[fF]")


def _may_hold_control_characters(raw: bytes) -> bool:
    return (len(raw.translate(None, _CONTROL_BYTES)) != len(raw)
            or (b"\xc2" in raw and _C1_IN_UTF8.search(raw) is not None)
            or (b"\\u00" in raw and _CONTROL_ESCAPE.search(raw) is not None))


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
    """pydantic's JSON parser refuses bytes that are not UTF-8, lone surrogate escapes and raw
    control characters in strings with a line and column only. For such a body, raise the
    error that names the field: decoded with surrogateescape, the bad bytes become surrogates
    that the text check finds, and Python's parser (not strict) takes raw control characters.
    Does nothing for other bodies, or when the body is not JSON anyway."""
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
    if len(raw) > limits.max_request_text_chars or _may_hold_control_characters(raw):
        limits.check_texts(json_texts(body))
    messages = getattr(body, "messages", None)
    if messages is not None:
        limits.check_messages(len(messages))
    if isinstance(body, SamplingFields):
        limits.check_n(body.n)
        limits.check_stop([body.stop] if isinstance(body.stop, str) else body.stop or [])
    if isinstance(body, ChatCompletionRequest):
        limits.check_logprobs(body.top_logprobs, "top_logprobs")
    if isinstance(body, CompletionRequest):
        limits.check_logprobs(body.logprobs)
        limits.check_prompts(num_prompts(body.prompt))


def num_prompts(prompt: str | list) -> int:
    """The prompt field's four shapes: a text, texts, token ids, lists of token ids."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        return 1
    return len(prompt)
