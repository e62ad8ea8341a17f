"""The public gRPC API through its generated stubs: one Generate call, collected."""
from __future__ import annotations

from dataclasses import dataclass, field

import grpc

from kvrelay.api.kvrelay.v1 import common_pb2, generation_pb2, generation_pb2_grpc


@dataclass
class Generated:
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: dict[int, list[int]] = field(default_factory=dict)  # per choice index
    text: dict[int, str] = field(default_factory=dict)
    finish_reason: dict[int, str] = field(default_factory=dict)
    usage: common_pb2.Usage | None = None


def generate(address: str, request: generation_pb2.GenerateRequest,
             timeout_s: float = 120) -> Generated:
    result = Generated()
    with grpc.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for response in stub.Generate(request, timeout=timeout_s):
            if response.prompt_token_ids:
                result.prompt_token_ids = list(response.prompt_token_ids)
            for choice in response.choices:
                result.token_ids.setdefault(choice.index, []).extend(choice.token_ids)
                result.text[choice.index] = result.text.get(choice.index, "") + choice.text
                if choice.finish_reason:
                    result.finish_reason[choice.index] = \
                        common_pb2.FinishReason.Name(choice.finish_reason)
            if response.HasField("usage"):
                result.usage = response.usage
    return result


def token_ids_request(prompt_ids: list[int], **params) -> generation_pb2.GenerateRequest:
    return generation_pb2.GenerateRequest(
        prompt_token_ids=generation_pb2.TokenIds(ids=prompt_ids),
        params=common_pb2.SamplingParams(**params))


def chat_request(messages: list[dict], **params) -> generation_pb2.GenerateRequest:
    chat = generation_pb2.ChatMessages(
        messages=[common_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages],
        add_generation_prompt=True)
    return generation_pb2.GenerateRequest(chat=chat, params=common_pb2.SamplingParams(**params))
