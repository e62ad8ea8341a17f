"""The public gRPC `Generation` service, on the same core as the REST API."""
from __future__ import annotations

import hmac
import uuid

import grpc

from services.api.kvrelay.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from services.common.log import bind_request_id
from services.wire import params_from_proto
from services.gateway.errors import GatewayError, invalid, param_from_value_error
from services.gateway.openai_serving import served_model
from services.gateway.request_group import RequestGroup
from services.gateway.request_state import SampleDelta

FINISH_REASONS = {None: common_pb2.FINISH_REASON_UNSPECIFIED,
                  "stop": common_pb2.FINISH_REASON_STOP,
                  "length": common_pb2.FINISH_REASON_LENGTH,
                  "abort": common_pb2.FINISH_REASON_ABORT,
                  "error": common_pb2.FINISH_REASON_ERROR}


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, core, api_key: str | None = None) -> None:
        self.core = core
        self.expected_authorization = f"Bearer {api_key}".encode() if api_key else None

    async def Generate(self, request, context):
        await self._authorize(context)
        request_id = request.request_id or f"gen-{uuid.uuid4().hex}"
        bind_request_id(request_id)
        try:
            group, prompt = await self._start(request, request_id)
        except GatewayError as exc:
            await context.abort(exc.grpc_code, exc.message)
        with group:  # a cancelled call leaves this block early, which aborts the request
            first = True
            async for _, deltas in group.steps():
                error = next((delta.error or "generation failed" for delta in deltas
                              if delta.finish_reason == "error"), None)
                if error is not None:
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED if group.timed_out
                                        else grpc.StatusCode.UNAVAILABLE, error)
                yield _response(group, request_id, deltas, prompt if first else None)
                first = False

    async def _start(self, request, request_id: str) -> tuple[RequestGroup, list[int]]:
        served_model(self.core, request.model or None)
        try:
            params = params_from_proto(request.params)
        except ValueError as exc:
            raise param_from_value_error(exc) from None
        prompt = await self._prompt_token_ids(request, request_id)
        group = await self.core.generate(request_id, [prompt], params, request.priority)
        return group, prompt

    async def _prompt_token_ids(self, request, request_id: str) -> list[int]:
        kind = request.WhichOneof("input")
        if kind == "prompt":
            prompt = await self.core.upstream.encode(request.prompt, True, request_id)
        elif kind == "prompt_token_ids":
            prompt = list(request.prompt_token_ids.ids)
        elif kind == "chat":
            prompt = await self.core.upstream.render_chat(
                _messages(request.chat), request.chat.add_generation_prompt, request_id)
        else:
            raise invalid("give a prompt, prompt_token_ids or chat", "prompt")
        if not prompt:
            raise invalid("prompt must not be empty", "prompt")
        return prompt

    async def Abort(self, request, context):
        await self._authorize(context)
        return generation_pb2.AbortResponse(found=await self.core.abort(request.request_id))

    async def ListModels(self, request, context):
        await self._authorize(context)
        try:
            model = served_model(self.core, None)
        except GatewayError as exc:
            await context.abort(exc.grpc_code, exc.message)
        return generation_pb2.ListModelsResponse(models=[generation_pb2.ModelInfo(
            id=model, max_model_len=self.core.max_model_len)])

    async def Tokenize(self, request, context):
        await self._authorize(context)
        try:
            served_model(self.core, request.model or None)
            token_ids = await self._tokenize(request)
        except GatewayError as exc:
            await context.abort(exc.grpc_code, exc.message)
        return generation_pb2.TokenizeResponse(token_ids=token_ids,
                                               max_model_len=self.core.max_model_len)

    async def _tokenize(self, request) -> list[int]:
        request_id = f"tok-{uuid.uuid4().hex}"
        kind = request.WhichOneof("input")
        if kind == "prompt":
            return await self.core.upstream.encode(request.prompt, request.add_special_tokens,
                                                   request_id)
        if kind == "chat":
            return await self.core.upstream.render_chat(
                _messages(request.chat), request.chat.add_generation_prompt, request_id)
        raise invalid("give a prompt or chat", "prompt")

    async def _authorize(self, context) -> None:
        if self.expected_authorization is None:
            return
        given = dict(context.invocation_metadata() or ()).get("authorization", "")
        if not hmac.compare_digest(given.encode(), self.expected_authorization):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "invalid or missing API key (metadata authorization: Bearer <key>)")


def _response(group: RequestGroup, request_id: str, deltas: list[SampleDelta],
              prompt: list[int] | None) -> generation_pb2.GenerateResponse:
    """One step's choices; the first carries the prompt's token ids, the last the usage."""
    response = generation_pb2.GenerateResponse(
        request_id=request_id, choices=[_choice(delta) for delta in deltas],
        prompt_token_ids=prompt or ())
    if group.num_open_samples == 0:
        response.usage.CopyFrom(common_pb2.Usage(
            prompt_tokens=group.num_prompt_tokens, completion_tokens=group.num_output_tokens,
            cached_prompt_tokens=group.num_cached_tokens))
    return response


def _choice(delta: SampleDelta) -> generation_pb2.ChoiceDelta:
    choice = generation_pb2.ChoiceDelta(
        index=delta.index, text=delta.text, token_ids=delta.token_ids,
        finish_reason=FINISH_REASONS[delta.finish_reason],
        stop_reason="" if delta.stop_reason is None else str(delta.stop_reason))
    for entry in delta.logprobs or ():
        choice.logprobs.append(common_pb2.TokenLogprob(
            token_id=entry.token_id, logprob=entry.logprob, rank=entry.rank,
            top=[common_pb2.TopLogprob(token_id=top.token_id, logprob=top.logprob)
                 for top in entry.top]))
    return choice


def _messages(chat) -> list[dict]:
    return [{"role": message.role, "content": message.content} for message in chat.messages]
