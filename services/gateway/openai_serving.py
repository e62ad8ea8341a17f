"""What the chat and completions endpoints share: the model check, usage, SSE framing, and
collecting a whole response while watching for the client to leave."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

from starlette.requests import Request
from starlette.responses import StreamingResponse

from kvrelay.gateway.errors import GatewayError, model_not_found
from kvrelay.gateway.request_group import RequestGroup
from kvrelay.gateway.request_state import SampleDelta

SSE_DONE = b"data: [DONE]\n\n"


def served_model(core, requested: str | None) -> str:
    """The model name for the response: the base model's or a loaded LoRA adapter's; an
    unknown one is a 404 model_not_found."""
    served = core.model_name
    if served is None:
        raise GatewayError("unavailable", "no model is being served yet")
    if requested is None or requested == served:
        return served
    adapters = core.adapter_names
    if requested not in adapters:
        raise model_not_found(requested, served, adapters)
    return requested


def lora_name(core, model: str) -> str:
    """The LoRA adapter a request runs with (served_model's answer); empty: the base model."""
    return "" if model == core.model_name else model


async def generation_model(core, requested: str | None) -> str:
    """served_model for a generation. The model is known once a scheduler group is ready; while
    none is (one restarting), the request waits for one as its submit would (up to
    --submit-wait-timeout) instead of answering 503 at once."""
    if core.model_name is None:
        await core.wait_for_ready_group()
    return served_model(core, requested)


def usage(group: RequestGroup) -> dict:
    prompt_tokens, completion_tokens = group.num_prompt_tokens, group.num_output_tokens
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": group.num_cached_tokens}}


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def sse(payload: dict) -> bytes:
    return b"data: " + _json(payload).encode() + b"\n\n"


class ChunkEncoder:
    """SSE events of one streamed response: the fields every chunk repeats (id, model, ...)
    are serialized once; each event serializes only its choices."""

    def __init__(self, header: dict) -> None:
        self.prefix = b"data: " + _json(header)[:-1].encode() + b',"choices":['

    def event(self, choice: dict) -> bytes:
        return self.prefix + _json(choice).encode() + b"]}\n\n"


def sse_error(message: str) -> bytes:
    """An error event mid-stream (the openai SDK raises it as an APIError)."""
    return sse(GatewayError("unavailable", message).body())


class EventStreamResponse(StreamingResponse):
    """SSE for one request group; however the response ends (done, client gone, error, or
    cancelled before the first chunk), the group is closed, which aborts what is unfinished."""

    def __init__(self, events, group: RequestGroup) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache"})
        self.group = group

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.group.close()


@dataclass(slots=True)
class ChoiceResult:
    """One choice of a non-streamed response, gathered from its deltas."""
    texts: list[str] = field(default_factory=list)
    num_tokens: list[int] = field(default_factory=list)  # each delta's, beside its text
    logprobs: list = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    error: str | None = None
    prompt_logprobs: list | None = None  # where asked: one per prompt token
    embedding: tuple[float, ...] = ()  # a request with pooling's

    def add(self, delta: SampleDelta) -> None:
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.embedding:
            self.embedding = delta.embedding
        self.texts.append(delta.text)
        self.num_tokens.append(len(delta.token_ids))
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
            self.error = delta.error

    @property
    def text(self) -> str:
        return "".join(self.texts)


async def collect_choices(group: RequestGroup, n: int) -> list[ChoiceResult]:
    """Every choice of the group, indexed prompt_index * n + sample index."""
    choices = [ChoiceResult() for _ in range(len(group.states) * n)]
    async for prompt_index, deltas in group.steps():
        for delta in deltas:
            choices[prompt_index * n + delta.index].add(delta)
    for choice in choices:
        if choice.finish_reason == "error":
            raise GatewayError("timeout" if group.timed_out else "unavailable",
                               choice.error or "generation failed")
    return choices


class ClientDisconnected(Exception):
    pass


async def unless_disconnected(request: Request, work):
    """Await `work`, or raise ClientDisconnected as soon as the HTTP client goes away."""
    work_task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work_task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        work_task.cancel()
    if work_task in done:
        return work_task.result()
    raise ClientDisconnected


async def _wait_for_disconnect(request: Request) -> None:
    # The body is already read, so the next message is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass
