"""An async client for kvrelay's public gRPC API (the `Generation` service of the gateway)."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Unpack

import grpc

from kvrelay.api.kvrelay.v1 import common_pb2, generation_pb2, generation_pb2_grpc
from kvrelay.client.types import (FINISH_REASONS, Choice, Completion, GenerationChunk,
                                   KvrelayError, ModelInfo, SamplingOptions, TokenLogprob, Usage)

Messages = list[dict[str, str]]


class KvrelayClient:
    """`async with KvrelayClient("127.0.0.1:50050") as client: ...`

    TLS: `tls=True` checks the gateway's certificate against the system's roots, or against
    `tls_ca` (PEM path) when given; `tls_cert` and `tls_key` add a client certificate for a
    gateway that asks for one (--public-tls-client-ca). `server_name` overrides the name the
    certificate must carry (default: the host of `address`)."""

    def __init__(self, address: str = "127.0.0.1:50050", api_key: str | None = None,
                 timeout: float | None = None, *, tls: bool = False, tls_ca: str | None = None,
                 tls_cert: str | None = None, tls_key: str | None = None,
                 server_name: str | None = None) -> None:
        if tls or tls_ca or tls_cert:
            options = [("grpc.ssl_target_name_override", server_name)] if server_name else []
            self.channel = grpc.aio.secure_channel(
                address, _credentials(tls_ca, tls_cert, tls_key), options=options)
        else:
            self.channel = grpc.aio.insecure_channel(address)
        self.stub = generation_pb2_grpc.GenerationStub(self.channel)
        self.metadata = (("authorization", f"Bearer {api_key}"),) if api_key else ()
        self.timeout = timeout  # seconds for a whole call; None: no limit

    async def __aenter__(self) -> "KvrelayClient":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    # ---- generation ----------------------------------------------------------------------------
    async def generate(self, prompt: str | None = None, *,
                       prompt_token_ids: list[int] | None = None,
                       messages: Messages | None = None, add_generation_prompt: bool = True,
                       model: str = "", request_id: str = "", priority: int = 0,
                       **sampling: Unpack[SamplingOptions]) -> AsyncIterator[GenerationChunk]:
        """Stream chunks as the model produces them. Give exactly one of `prompt`,
        `prompt_token_ids` or chat `messages`. Leaving the loop early aborts the request."""
        request = _generate_request(prompt, prompt_token_ids, messages, add_generation_prompt,
                                    model, request_id, priority, sampling)
        call = self.stub.Generate(request, metadata=self.metadata, timeout=self.timeout)
        try:
            async for response in call:
                for chunk in _chunks(response):
                    yield chunk
        except grpc.aio.AioRpcError as exc:
            raise KvrelayError(exc.code().name, exc.details() or "") from None
        finally:
            call.cancel()  # no-op once finished; otherwise the gateway aborts the request

    async def complete(self, prompt: str | None = None, **kwargs) -> Completion:
        """The whole result of `generate` (same arguments)."""
        completion = Completion("", [], [], None)
        async for chunk in self.generate(prompt, **kwargs):
            _add_chunk(completion, chunk)
        return completion

    async def chat(self, messages: Messages, **kwargs) -> Completion:
        """`complete` for a conversation rendered with the model's chat template."""
        return await self.complete(messages=messages, **kwargs)

    async def abort(self, request_id: str) -> bool:
        """Abort a running request by id; False when the gateway does not know it."""
        reply = await self._unary(self.stub.Abort,
                                  generation_pb2.AbortRequest(request_id=request_id))
        return reply.found

    # ---- models and tokens ---------------------------------------------------------------------
    async def list_models(self) -> list[ModelInfo]:
        reply = await self._unary(self.stub.ListModels, generation_pb2.ListModelsRequest())
        return [ModelInfo(model.id, model.max_model_len) for model in reply.models]

    async def tokenize(self, prompt: str | None = None, *, messages: Messages | None = None,
                       add_special_tokens: bool = True, add_generation_prompt: bool = True,
                       model: str = "") -> list[int]:
        request = generation_pb2.TokenizeRequest(model=model,
                                                 add_special_tokens=add_special_tokens)
        if (prompt is None) == (messages is None):
            raise ValueError("give either a prompt or messages")
        if prompt is not None:
            request.prompt = prompt
        else:
            request.chat.CopyFrom(_chat(messages, add_generation_prompt))
        return list((await self._unary(self.stub.Tokenize, request)).token_ids)

    async def _unary(self, method, request):
        try:
            return await method(request, metadata=self.metadata, timeout=self.timeout)
        except grpc.aio.AioRpcError as exc:
            raise KvrelayError(exc.code().name, exc.details() or "") from None


def _generate_request(prompt, prompt_token_ids, messages, add_generation_prompt, model,
                      request_id, priority, sampling) -> generation_pb2.GenerateRequest:
    if sum(x is not None for x in (prompt, prompt_token_ids, messages)) != 1:
        raise ValueError("give exactly one of prompt, prompt_token_ids or messages")
    request = generation_pb2.GenerateRequest(request_id=request_id, model=model,
                                             priority=priority, params=_params(sampling))
    if prompt is not None:
        request.prompt = prompt
    elif prompt_token_ids is not None:
        request.prompt_token_ids.ids.extend(prompt_token_ids)
    else:
        request.chat.CopyFrom(_chat(messages, add_generation_prompt))
    return request


def _params(sampling: SamplingOptions) -> common_pb2.SamplingParams:
    values = {name: value for name, value in sampling.items() if value is not None}
    if isinstance(values.get("stop"), str):
        values["stop"] = [values["stop"]]
    if "structured_outputs" in values:
        values["structured_outputs"] = _structured(values["structured_outputs"])
    if "allowed_token_ids" in values:
        values["allowed_token_ids"] = common_pb2.TokenIdList(ids=values["allowed_token_ids"])
    try:
        return common_pb2.SamplingParams(**values)
    except (ValueError, TypeError) as exc:  # unknown names, wrong types, out of range
        raise ValueError(f"bad sampling option: {exc}") from None


def _structured(spec: dict) -> common_pb2.StructuredOutputs:
    """vLLM's {"kind": value} form -> the wire's oneof (the server checks the value)."""
    if not isinstance(spec, dict) or len(spec) != 1:
        raise ValueError("structured_outputs takes one of json, regex, choice, grammar, "
                         "json_object")
    (kind, value), = spec.items()
    if kind == "json":
        return common_pb2.StructuredOutputs(
            json=value if isinstance(value, str) else json.dumps(value))
    if kind == "choice":
        return common_pb2.StructuredOutputs(choice=common_pb2.ChoiceList(choices=list(value)))
    if kind in ("regex", "grammar", "json_object"):
        return common_pb2.StructuredOutputs(**{kind: value})
    raise ValueError(f"unknown structured output kind {kind!r}")


def _chat(messages: Messages, add_generation_prompt: bool) -> generation_pb2.ChatMessages:
    return generation_pb2.ChatMessages(
        messages=[common_pb2.ChatMessage(role=m["role"], content=m["content"])
                  for m in messages], add_generation_prompt=add_generation_prompt)


def _chunks(response) -> list[GenerationChunk]:
    usage = (Usage(response.usage.prompt_tokens, response.usage.completion_tokens,
                   response.usage.cached_prompt_tokens) if response.HasField("usage") else None)
    chunks = [GenerationChunk(
        request_id=response.request_id, index=choice.index, text=choice.text,
        token_ids=list(choice.token_ids),
        logprobs=_logprobs(choice.logprobs), finish_reason=FINISH_REASONS[choice.finish_reason],
        stop_reason=choice.stop_reason or None,
        prompt_logprobs=_logprobs(choice.prompt_logprobs)) for choice in response.choices]
    if chunks and usage is not None:  # the request's last chunk carries its usage
        chunks[-1] = replace(chunks[-1], usage=usage)
    if chunks and response.prompt_token_ids:
        chunks[0] = replace(chunks[0], prompt_token_ids=list(response.prompt_token_ids))
    return chunks


def _logprobs(entries) -> list[TokenLogprob] | None:
    return [TokenLogprob(entry.token_id, entry.logprob, entry.rank,
                         {top.token_id: top.logprob for top in entry.top})
            for entry in entries] or None


def _add_chunk(completion: Completion, chunk: GenerationChunk) -> None:
    completion.request_id = chunk.request_id
    if chunk.prompt_token_ids is not None:
        completion.prompt_token_ids = chunk.prompt_token_ids
    while len(completion.choices) <= chunk.index:
        completion.choices.append(Choice(len(completion.choices)))
    choice = completion.choices[chunk.index]
    choice.text += chunk.text
    choice.token_ids.extend(chunk.token_ids)
    if chunk.prompt_logprobs is not None:
        choice.prompt_logprobs = chunk.prompt_logprobs
    if chunk.logprobs:
        if choice.logprobs is None:
            choice.logprobs = []
        choice.logprobs.extend(chunk.logprobs)
    if chunk.finish_reason is not None:
        choice.finish_reason, choice.stop_reason = chunk.finish_reason, chunk.stop_reason
    if chunk.usage is not None:
        completion.usage = chunk.usage


def _credentials(ca: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials:
    if bool(cert) != bool(key):
        raise ValueError("a client certificate needs both tls_cert and tls_key")

    def read(path: str | None) -> bytes | None:
        if path is None:
            return None
        with open(path, "rb") as handle:
            return handle.read()
    return grpc.ssl_channel_credentials(root_certificates=read(ca), private_key=read(key),
                                        certificate_chain=read(cert))
