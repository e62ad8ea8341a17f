"""The public gRPC `Generation` service, on the same core as the REST API."""
from __future__ import annotations

import hmac
import re
import uuid

import grpc
from google.protobuf.json_format import MessageToDict
from google.protobuf.message import DecodeError

from kvrelay.api.kvrelay.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from kvrelay.common.log import bind_request_id, get_logger
from kvrelay.wire import params_from_proto
from kvrelay.gateway import edge
from kvrelay.gateway.errors import GatewayError, invalid, param_from_value_error
from kvrelay.gateway.limits import RequestLimits
from kvrelay.gateway.openai_embeddings import embed
from kvrelay.gateway.lora_admin import (load_adapter, model_cards, require_admin_key,
                                        unload_adapter)
from kvrelay.gateway.openai_serving import generation_model, lora_name, served_model
from kvrelay.gateway.request_group import RequestGroup
from kvrelay.gateway.request_state import SampleDelta
from kvrelay.gateway.proto_text_fields import proto_texts, undecodable_string_field
from kvrelay.tokenizer.tool_render import parse_tool_calls

log = get_logger(__name__)

# the core's finish reason -> the wire's: the edge's map, inverted
FINISH_REASONS = {reason: code for code, reason in edge.FINISH_REASONS.items()}


class MalformedRequest:
    """A request message that did not parse, or is over the size limit: its handler answers
    with this status (an exception in the deserializer would reach the client as UNKNOWN)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        self.code = code
        self.message = message


def add_generation_service(servicer: "GenerationServicer", server) -> None:
    """generation_pb2_grpc.add_GenerationServicer_to_server, with request parsers that hand a
    malformed or oversized message to the handler as a MalformedRequest."""
    service = generation_pb2.DESCRIPTOR.services_by_name["Generation"]
    handlers = {}
    for method in service.methods:
        request_class = getattr(generation_pb2, method.input_type.name)
        response_class = getattr(generation_pb2, method.output_type.name)
        handler = (grpc.unary_stream_rpc_method_handler if method.server_streaming
                   else grpc.unary_unary_rpc_method_handler)
        handlers[method.name] = handler(
            getattr(servicer, method.name),
            request_deserializer=_request_parser(request_class, servicer.core.limits),
            response_serializer=response_class.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name,
                                                                           handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def _request_parser(request_class, limits: RequestLimits):
    def parse(data: bytes):
        if len(data) > limits.max_request_body_bytes:  # gRPC's own limit is internal traffic's
            return MalformedRequest(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                    f"the request message is larger than "
                                    f"{limits.max_request_body_bytes} bytes")
        try:
            return request_class.FromString(data)
        except DecodeError as exc:
            field = undecodable_string_field(request_class.DESCRIPTOR, data)
            return MalformedRequest(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"{field} is not valid UTF-8" if field
                                    else f"the request does not parse: {exc}")
    return parse


class GenerationServicer(generation_pb2_grpc.GenerationServicer):
    def __init__(self, core, api_key: str | None = None) -> None:
        self.core = core
        self.expected_authorization = f"Bearer {api_key}".encode() if api_key else None

    async def Generate(self, request, context):
        await self._admit(request, context)
        try:
            client_request_id = _client_request_id(request.request_id, "gen")
            _check_generate_limits(self.core.limits, request)
            group, prompt = await self._start(request, client_request_id)
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
                yield _response(group, client_request_id, deltas, prompt if first else None)
                first = False

    async def _start(self, request, client_request_id: str) -> tuple[RequestGroup, list[int]]:
        model = await generation_model(self.core, request.model or None)
        try:
            params = params_from_proto(request.params)
        except ValueError as exc:
            raise param_from_value_error(exc) from None
        prompt = await self._prompt_token_ids(request, client_request_id)
        self.core.limits.check_prompt_tokens([prompt], request.WhichOneof("input"))
        group = await self.core.generate(client_request_id, [prompt], params, request.priority,
                                        lora_name(self.core, model))
        return group, prompt

    async def _prompt_token_ids(self, request, client_request_id: str) -> list[int]:
        kind = request.WhichOneof("input")
        if kind == "prompt":
            prompt = await self.core.upstream.encode(request.prompt, True, client_request_id)
        elif kind == "prompt_token_ids":
            prompt = list(request.prompt_token_ids.ids)
        elif kind == "chat":
            prompt = await self.core.upstream.render_chat(
                _messages(request.chat), request.chat.add_generation_prompt, client_request_id)
        else:
            raise invalid("give a prompt, prompt_token_ids or chat", "prompt")
        if not prompt:
            raise invalid("prompt must not be empty", "prompt")
        return prompt

    async def Embed(self, request, context):
        await self._admit(request, context)
        try:
            client_request_id = _client_request_id(request.request_id, "embd")
            model = await generation_model(self.core, request.model or None)
            prompts = await self._embed_inputs(request, client_request_id)
            vectors = await embed(self.core, None, prompts, client_request_id,
                                  request.priority, lora_name(self.core, model))
        except GatewayError as exc:
            await context.abort(exc.grpc_code, exc.message)
        return generation_pb2.EmbedResponse(
            request_id=client_request_id,
            embeddings=[generation_pb2.Embedding(values=vector) for vector in vectors],
            usage=common_pb2.Usage(prompt_tokens=sum(map(len, prompts))))

    async def _embed_inputs(self, request, client_request_id: str) -> list[list[int]]:
        if bool(request.texts) == bool(request.token_ids):
            raise invalid("give either texts or token_ids", "texts")
        limits = self.core.limits
        limits.check_prompts(len(request.texts) + len(request.token_ids), "texts")
        prompts = [list(ids.ids) for ids in request.token_ids] or [
            await self.core.upstream.encode(text, True, client_request_id)
            for text in request.texts]
        if not all(prompts):
            raise invalid("an input is empty", "texts" if request.texts else "token_ids")
        limits.check_prompt_tokens(prompts, "texts" if request.texts else "token_ids")
        return prompts

    async def Abort(self, request, context):
        await self._admit(request, context)
        return generation_pb2.AbortResponse(found=await self.core.abort(request.request_id))

    async def ListModels(self, request, context):
        await self._admit(request, context)
        try:
            model = served_model(self.core, None)
        except GatewayError as exc:
            await context.abort(exc.grpc_code, exc.message)
        return generation_pb2.ListModelsResponse(models=[generation_pb2.ModelInfo(
            id=card["id"], max_model_len=card["max_model_len"], parent=card["parent"] or "")
            for card in model_cards(self.core, model)])

    async def LoadLoraAdapter(self, request, context):
        await self._admit(request, context)
        try:
            require_admin_key(self.expected_authorization)
            if not request.lora_name or not request.lora_path:
                raise invalid("give lora_name and lora_path", "lora_name")
            await load_adapter(self.core, request.lora_name, request.lora_path)
        except GatewayError as exc:
            await context.abort(exc.grpc_code, exc.message)
        return generation_pb2.LoadLoraAdapterResponse()

    async def UnloadLoraAdapter(self, request, context):
        await self._admit(request, context)
        try:
            require_admin_key(self.expected_authorization)
            await unload_adapter(self.core, request.lora_name)
        except GatewayError as exc:
            await context.abort(exc.grpc_code, exc.message)
        return generation_pb2.UnloadLoraAdapterResponse()

    async def Tokenize(self, request, context):
        await self._admit(request, context)
        try:
            if request.HasField("chat"):
                self.core.limits.check_messages(len(request.chat.messages), "chat.messages")
            served_model(self.core, request.model or None)
            token_ids = await self._tokenize(request)
        except GatewayError as exc:
            await context.abort(exc.grpc_code, exc.message)
        return generation_pb2.TokenizeResponse(token_ids=token_ids,
                                               max_model_len=self.core.max_model_len)

    async def _tokenize(self, request) -> list[int]:
        client_request_id = f"tok-{uuid.uuid4().hex}"
        kind = request.WhichOneof("input")
        if kind == "prompt":
            return await self.core.upstream.encode(request.prompt, request.add_special_tokens,
                                                   client_request_id)
        if kind == "chat":
            return await self.core.upstream.render_chat(
                _messages(request.chat), request.chat.add_generation_prompt, client_request_id)
        raise invalid("give a prompt or chat", "prompt")

    async def _admit(self, request, context) -> None:
        """What every call passes first: the API key, a message that parsed, and text that is
        UTF-8, not too much of it (limits.py)."""
        await self._authorize(context)
        if isinstance(request, MalformedRequest):
            await context.abort(request.code, request.message)
        try:
            self.core.limits.check_texts(proto_texts(request))
        except GatewayError as exc:
            await context.abort(exc.grpc_code, exc.message)
        if self.core.log_request_text:  # off by default: prompts are the users' data
            log.info("request text", request=MessageToDict(request))

    async def _authorize(self, context) -> None:
        if self.expected_authorization is None:
            return
        given = dict(context.invocation_metadata() or ()).get("authorization", "")
        if not hmac.compare_digest(given.encode(), self.expected_authorization):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                                "invalid or missing API key (metadata authorization: Bearer <key>)")


_REQUEST_ID = re.compile(r"[\x20-\x7e]{1,256}")  # what gRPC metadata carries as it is


def _client_request_id(given: str, prefix: str) -> str:
    """The client's request_id (else a new one), bound to the logs; it travels upstream as
    metadata, so it must be printable ASCII, at most 256 characters."""
    if given and not _REQUEST_ID.fullmatch(given):
        raise invalid("request_id must be at most 256 printable ASCII characters",
                      "request_id")
    client_request_id = given or f"{prefix}-{uuid.uuid4().hex}"
    bind_request_id(client_request_id)
    return client_request_id


def _check_generate_limits(limits: RequestLimits, request) -> None:
    """The limits of limits.py that a GenerateRequest's fields must meet, as REST's do."""
    if request.HasField("chat"):
        limits.check_messages(len(request.chat.messages), "chat.messages")
    params = request.params
    if params.HasField("n"):
        limits.check_n(params.n, "params.n")
    limits.check_stop(list(params.stop), "params.stop")
    if params.HasField("logprobs"):
        limits.check_logprobs(params.logprobs, "params.logprobs")
    if params.HasField("prompt_logprobs"):
        limits.check_logprobs(params.prompt_logprobs, "params.prompt_logprobs")
    if params.pooling:
        raise invalid("params.pooling: embeddings come from the Embed call",
                      "params.pooling")


def _response(group: RequestGroup, client_request_id: str, deltas: list[SampleDelta],
              prompt: list[int] | None) -> generation_pb2.GenerateResponse:
    """One step's choices; the first carries the prompt's token ids, the last the usage."""
    response = generation_pb2.GenerateResponse(
        request_id=client_request_id, choices=[_choice(delta) for delta in deltas],
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
    choice.logprobs.extend(_logprob(entry) for entry in delta.logprobs or ())
    if delta.prompt_logprobs:
        choice.prompt_logprobs.extend(_logprob(entry) for entry in delta.prompt_logprobs[1:])
    return choice


def _logprob(entry) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=entry.token_id, logprob=entry.logprob, rank=entry.rank,
        top=[common_pb2.TopLogprob(token_id=top.token_id, logprob=top.logprob)
             for top in entry.top])


def _messages(chat) -> list[dict]:
    """The chat as upstream.render_chat takes it; a tool_calls_json that is not a list of
    {"name", "arguments" (an object)} is INVALID_ARGUMENT naming chat.messages."""
    return [{"role": message.role, "content": message.content,
             "tool_calls": _calls(message.tool_calls_json),
             "tool_call_id": message.tool_call_id, "name": message.name}
            for message in chat.messages]


def _calls(tool_calls_json: str) -> list | None:
    if not tool_calls_json:
        return None
    try:
        return parse_tool_calls(tool_calls_json)
    except ValueError as exc:
        raise invalid(str(exc), "chat.messages") from None
