"""The gateway's upstream services: the tokenizer's calls (errors turned into GatewayError, the
client's request id sent along as metadata, replies as plain values), its Detokenize stream in
the core's types (edge.py), and the scheduler groups (scheduler_group.py)."""
from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvrelay.api.kvrelay.v1 import common_pb2, tokenizer_pb2, tokenizer_pb2_grpc
from kvrelay.common.grpc_server import channel
from kvrelay.common.log import request_metadata
from kvrelay.gateway.edge import DetokenizeStream
from kvrelay.gateway.errors import from_rpc_error
from kvrelay.gateway.scheduler_group import CALL_TIMEOUT_S, SchedulerGroup
from kvrelay.tokenizer.tool_render import KVRELAY

WATCH_RETRY_S = 0.5
# Requests in flight wait (--tokenizer-wait-timeout) for a lost tokenizer: gRPC's own reconnect
# backoff (1 s, growing to 2 min) could notice a restarted one long after it serves. Bounded.
TOKENIZER_RECONNECT_OPTIONS = [("grpc.initial_reconnect_backoff_ms", 100),
                               ("grpc.max_reconnect_backoff_ms", 1000)]


def _chat_message(message: dict) -> common_pb2.ChatMessage:
    calls = message.get("tool_calls")
    return common_pb2.ChatMessage(
        role=message["role"], content=message["content"],
        tool_calls_json=json.dumps(calls) if calls else "",
        tool_call_id=message.get("tool_call_id") or "", name=message.get("name") or "")


class Upstream:
    def __init__(self, tokenizer_address: str, scheduler_addresses: list[str]) -> None:
        self.tokenizer_channel = channel(tokenizer_address, "tokenizer",
                                         TOKENIZER_RECONNECT_OPTIONS)
        self.tokenizer = tokenizer_pb2_grpc.TokenizerStub(self.tokenizer_channel)
        self.tokenizer_health = health_pb2_grpc.HealthStub(self.tokenizer_channel)
        self.groups = [SchedulerGroup(address) for address in scheduler_addresses]

    async def close(self) -> None:
        await self.tokenizer_channel.close()
        for group in self.groups:
            await group.close()

    # ---- tokenizer -----------------------------------------------------------------------------
    async def encode(self, prompt: str, add_special_tokens: bool,
                     client_request_id: str) -> list[int]:
        return await self._encode(tokenizer_pb2.EncodeRequest(
            prompt=prompt, add_special_tokens=add_special_tokens), client_request_id)

    async def render_chat(self, messages: list[dict], add_generation_prompt: bool,
                          client_request_id: str) -> list[int]:
        token_ids, _ = await self.render_chat_with_tools(messages, add_generation_prompt,
                                                         client_request_id)
        return token_ids

    async def render_chat_with_tools(self, messages: list[dict], add_generation_prompt: bool,
                                     client_request_id: str, tools: list[dict] | None = None,
                                     reasoning_effort: str | None = None,
                                     ) -> tuple[list[int], str]:
        """messages: role and content, and where present tool_calls ([{"name", "arguments"
        (an object)}]), tool_call_id and name; tools: the definitions in play. Returns the
        prompt and how the model calls tools ("hermes" or "kvrelay", tool_render.py)."""
        chat = tokenizer_pb2.ChatRender(
            messages=[_chat_message(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            tools_json=json.dumps(tools) if tools else "", reasoning_effort=reasoning_effort or "")
        reply = await self._encode_reply(tokenizer_pb2.EncodeRequest(chat=chat),
                                         client_request_id)
        return list(reply.token_ids), reply.tool_call_format or KVRELAY

    async def _encode(self, request, client_request_id: str) -> list[int]:
        return list((await self._encode_reply(request, client_request_id)).token_ids)

    async def _encode_reply(self, request, client_request_id: str):
        try:
            return await self.tokenizer.Encode(
                request, metadata=request_metadata(client_request_id), timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, "tokenizer") from None

    async def decode(self, token_ids: list[int], client_request_id: str,
                     skip_special_tokens: bool = True) -> str:
        request = tokenizer_pb2.DecodeRequest(token_ids=token_ids,
                                              skip_special_tokens=skip_special_tokens)
        try:
            reply = await self.tokenizer.Decode(
                request, metadata=request_metadata(client_request_id), timeout=CALL_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, "tokenizer") from None
        return reply.text

    def open_detokenize(self) -> DetokenizeStream:
        return DetokenizeStream(self.tokenizer.Detokenize(wait_for_ready=True))

    async def watch_tokenizer(self, on_change: Callable[[bool], None]) -> None:
        """Report the tokenizer's health whenever it changes (grpc.health.v1 Watch): no traffic
        while nothing changes. A broken stream counts as not serving until it is back."""
        while True:
            call = self.tokenizer_health.Watch(health_pb2.HealthCheckRequest(service=""))
            try:
                async for reply in call:
                    on_change(reply.status == health_pb2.HealthCheckResponse.SERVING)
            except grpc.RpcError:
                pass
            finally:
                call.cancel()
            on_change(False)
            await asyncio.sleep(WATCH_RETRY_S)
