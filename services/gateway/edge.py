"""The gateway's edge to the scheduler and tokenizer: their protobuf messages to the core's
dataclasses (messages.py) and back, and the two streams (Outputs, Detokenize) wrapped so that
they read and write the core's types. Nothing past this module and its callers
(scheduler_group.py, upstream.py) sees a `_pb2` type.

Deltas and detokenize items are converted once per token per sample, on the streaming hot path:
plain attribute copies into slotted dataclasses, no dicts."""
from __future__ import annotations

import asyncio

import grpc

from kvrelay.api.kvrelay.v1 import common_pb2, scheduler_pb2, tokenizer_pb2
from kvrelay.gateway.messages import (Detokenized, DetokenizeItem, Generation, OutputDelta,
                                       SampledLogprob, SchedulerStats, WorkerLoad)
from kvrelay.wire import params_to_proto

FINISH_REASONS = {
    common_pb2.FINISH_REASON_UNSPECIFIED: None,
    common_pb2.FINISH_REASON_STOP: "stop",
    common_pb2.FINISH_REASON_LENGTH: "length",
    common_pb2.FINISH_REASON_ABORT: "abort",
    common_pb2.FINISH_REASON_ERROR: "error",
}


# ---- scheduler -----------------------------------------------------------------------------------
def stats_from_proto(message: scheduler_pb2.StatsResponse) -> SchedulerStats:
    return SchedulerStats(
        ready=message.ready, model=message.model, max_model_len=message.max_model_len,
        num_waiting=message.num_waiting, num_running=message.num_running,
        workers=tuple(WorkerLoad(w.num_blocks, w.num_free_blocks) for w in message.workers),
        adapters=tuple(adapter.name for adapter in message.adapters),
        max_loras=message.max_loras)


def submit_requests(generation: Generation) -> list[scheduler_pb2.SubmitRequest]:
    """One SubmitRequest per prompt; the sampling parameters are converted once for all."""
    params = params_to_proto(generation.params)
    return [scheduler_pb2.SubmitRequest(
        request_id=prompt.request_id, gateway_id=generation.gateway_id,
        prompt_token_ids=prompt.prompt_token_ids, params=params, priority=generation.priority,
        lora_name=generation.lora_name)
        for prompt in generation.prompts]


def output_deltas(batch: scheduler_pb2.OutputBatch) -> list[OutputDelta]:
    return [OutputDelta(
        delta.request_id, delta.index, list(delta.new_token_ids),
        FINISH_REASONS[delta.finish_reason],
        delta.stop_token_id if delta.HasField("stop_token_id") else None,
        _logprobs(delta.logprobs) if delta.logprobs else (),
        delta.error, delta.num_cached_prompt_tokens,
        _logprobs(delta.prompt_logprobs) if delta.prompt_logprobs else (),
        tuple(delta.embedding)) for delta in batch.deltas]


def _logprobs(entries) -> tuple[SampledLogprob, ...]:
    return tuple(SampledLogprob(entry.token_id, entry.logprob, entry.rank,
                                tuple((top.token_id, top.logprob) for top in entry.top))
                 for entry in entries)


# How long an Outputs stream must stay open, without initial metadata, to count as registered.
REGISTER_GRACE_S = 1.0


class OutputsStream:
    """A group's Outputs stream: each step's deltas as a list of OutputDelta."""

    def __init__(self, call) -> None:
        self.call = call

    async def registered(self) -> None:
        """Wait until the scheduler has surely registered this gateway's stream, so that no
        Submit can overtake it. A scheduler that sends initial metadata on registering says so
        at once; otherwise a stream still open after a grace period has run its handler (a
        stream that failed meanwhile raises when it is read)."""
        metadata = asyncio.ensure_future(self.call.initial_metadata())
        metadata.add_done_callback(lambda future: future.cancelled() or future.exception())
        await asyncio.wait({metadata}, timeout=REGISTER_GRACE_S)

    async def __aiter__(self):
        async for batch in self.call:
            yield output_deltas(batch)

    def cancel(self) -> None:
        self.call.cancel()


# ---- tokenizer -----------------------------------------------------------------------------------
def detokenize_batch(items: list[DetokenizeItem]) -> tokenizer_pb2.DetokenizeBatch:
    return tokenizer_pb2.DetokenizeBatch(items=[_detokenize_item(item) for item in items])


def _detokenize_item(item: DetokenizeItem) -> tokenizer_pb2.DetokenizeItem:
    message = tokenizer_pb2.DetokenizeItem(
        request_id=item.sequence_id, new_token_ids=item.new_token_ids, finished=item.finished,
        skip_special_tokens=item.skip_special_tokens)
    if item.piece_token_ids:  # most requests want no logprobs
        message.piece_token_ids.extend(item.piece_token_ids)
    if item.resume_token_ids:  # only after a broken stream
        message.resume_token_ids.extend(item.resume_token_ids)
    return message


def detokenized(result: tokenizer_pb2.DetokenizeBatchResult) -> list[Detokenized]:
    return [Detokenized(item.text, list(item.pieces) if item.pieces else ())
            for item in result.results]


class DetokenizeStream:
    """One Detokenize stream: writes lists of DetokenizeItem, reads lists of Detokenized (None
    at its end). code() and details() say why it ended."""

    def __init__(self, call) -> None:
        self.call = call

    async def write(self, items: list[DetokenizeItem]) -> None:
        await self.call.write(detokenize_batch(items))

    async def read(self) -> list[Detokenized] | None:
        result = await self.call.read()
        return None if result is grpc.aio.EOF else detokenized(result)

    def cancel(self) -> None:
        self.call.cancel()

    async def code(self) -> grpc.StatusCode:
        return await self.call.code()

    async def details(self) -> str:
        return await self.call.details()
