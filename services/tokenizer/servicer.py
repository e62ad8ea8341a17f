"""The Tokenizer gRPC service: Encode, Decode and the batched Detokenize stream."""
from __future__ import annotations

import grpc

from kvrelay.api.kvrelay.v1 import tokenizer_pb2, tokenizer_pb2_grpc
from kvrelay.common.log import bind_request_id, get_logger, request_id_from
from kvrelay.common.metrics import counter, gauge
from kvrelay.tokenizer.text import DetokenizeSession, check_token_ids, render_chat, token_pieces
from kvrelay.tokenizer.tool_render import (KVRELAY, parse_tool_calls, parse_tools,
                                            template_inputs, tool_call_format)

log = get_logger(__name__)

REQUESTS = counter("tokenizer_requests_total", "Tokenizer RPCs served, by method", ("method",))
TOKENS = counter("tokenizer_tokens_total",
                 "Tokens produced by Encode or consumed by Decode/Detokenize", ("method",))
OPEN_STREAMS = gauge("tokenizer_detokenize_streams", "Open Detokenize streams")
OPEN_STATES = gauge("tokenizer_detokenize_states", "Detokenizer states held across all streams")


def _message(message) -> dict:
    """A ChatMessage as tool_render.py takes it. Raises ValueError for calls that are not JSON."""
    converted = {"role": message.role, "content": message.content}
    if message.tool_calls_json:
        converted["tool_calls"] = parse_tool_calls(message.tool_calls_json)
    if message.tool_call_id:
        converted["tool_call_id"] = message.tool_call_id
    if message.name:
        converted["name"] = message.name
    return converted


class TokenizerServicer(tokenizer_pb2_grpc.TokenizerServicer):
    """Serves once `load` has set the tokenizer; before that every call is UNAVAILABLE (the
    server starts first so health checks see NOT_SERVING while a GGUF converts)."""

    def __init__(self, tool_call_parser: str = "auto") -> None:
        self.tokenizer = None
        self.vocab_size = 0
        self.tool_call_parser = tool_call_parser  # --tool-call-parser
        self.tool_call_format = KVRELAY

    def load(self, tokenizer) -> None:
        self.vocab_size = len(tokenizer)
        self.tool_call_format = tool_call_format(getattr(tokenizer, "chat_template", None),
                                                 self.tool_call_parser)
        self.tokenizer = tokenizer

    async def _check_loaded(self, context) -> None:
        if self.tokenizer is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the tokenizer is still loading")

    async def Encode(self, request, context):
        await self._check_loaded(context)
        bind_request_id(request_id_from(context))
        REQUESTS.labels("encode").inc()
        try:
            token_ids = self._encode(request)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        TOKENS.labels("encode").inc(len(token_ids))
        return tokenizer_pb2.EncodeResponse(
            token_ids=token_ids,
            tool_call_format=self.tool_call_format if request.HasField("chat") else "")

    def _encode(self, request) -> list[int]:
        kind = request.WhichOneof("input")
        if kind == "prompt":
            return self.tokenizer.encode(request.prompt,
                                         add_special_tokens=request.add_special_tokens)
        if kind == "chat":
            chat = request.chat
            messages, tools = template_inputs([_message(m) for m in chat.messages],
                                              parse_tools(chat.tools_json), self.tool_call_format)
            return render_chat(self.tokenizer, messages, chat.add_generation_prompt, tools,
                               chat.reasoning_effort)
        raise ValueError("EncodeRequest needs a prompt or a chat")

    async def Decode(self, request, context):
        await self._check_loaded(context)
        bind_request_id(request_id_from(context))
        REQUESTS.labels("decode").inc()
        try:
            check_token_ids(request.token_ids, self.vocab_size)
        except ValueError as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        TOKENS.labels("decode").inc(len(request.token_ids))
        text = self.tokenizer.decode(list(request.token_ids),
                                     skip_special_tokens=request.skip_special_tokens)
        return tokenizer_pb2.DecodeResponse(text=text)

    async def Detokenize(self, request_iterator, context):
        await self._check_loaded(context)
        REQUESTS.labels("detokenize").inc()
        session = DetokenizeSession(self.tokenizer)
        OPEN_STREAMS.inc()
        try:
            async for batch in request_iterator:
                before = session.num_open
                try:
                    result = self._detokenize_batch(session, batch)
                except ValueError as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                OPEN_STATES.inc(session.num_open - before)
                yield result
        finally:
            OPEN_STATES.dec(session.num_open)
            OPEN_STREAMS.dec()

    def _detokenize_batch(self, session: DetokenizeSession, batch):
        results = []
        num_tokens = 0
        for item in batch.items:
            check_token_ids(item.new_token_ids, self.vocab_size)
            check_token_ids(item.resume_token_ids, self.vocab_size)
            text = session.step(item.request_id, item.new_token_ids, item.finished,
                                item.skip_special_tokens, item.resume_token_ids)
            result = tokenizer_pb2.DetokenizeResult(request_id=item.request_id, text=text)
            if item.piece_token_ids:
                check_token_ids(item.piece_token_ids, self.vocab_size)
                result.pieces.extend(token_pieces(self.tokenizer, item.piece_token_ids))
            results.append(result)
            num_tokens += len(item.new_token_ids)
        TOKENS.labels("detokenize").inc(num_tokens)
        return tokenizer_pb2.DetokenizeBatchResult(results=results)
