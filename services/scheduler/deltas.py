"""Token deltas for the gateways: gathered during a step, sent once per step per gateway."""
from __future__ import annotations

import asyncio
from collections import defaultdict

from services.api.kvrelay.v1 import common_pb2, scheduler_pb2
from services.engine.request import Request, RequestStatus
from services.engine.scheduler import Scheduler

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: common_pb2.FINISH_REASON_STOP,
    RequestStatus.FINISHED_LENGTH: common_pb2.FINISH_REASON_LENGTH,
    RequestStatus.FINISHED_ABORTED: common_pb2.FINISH_REASON_ABORT,
}


class DeltaSink:
    """Per-gateway outboxes. `emit` buffers; `flush` sends each gateway one OutputBatch."""

    def __init__(self) -> None:
        self.pending: dict[str, list[scheduler_pb2.SequenceDelta]] = defaultdict(list)
        self.streams: dict[str, asyncio.Queue] = {}

    def emit(self, gateway_id: str, delta: scheduler_pb2.SequenceDelta) -> None:
        self.pending[gateway_id].append(delta)

    def flush(self) -> None:
        for gateway_id, deltas in self.pending.items():
            queue = self.streams.get(gateway_id)
            if queue is not None:
                queue.put_nowait(scheduler_pb2.OutputBatch(deltas=deltas))
        self.pending.clear()

    def subscribe(self, gateway_id: str) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[gateway_id] = queue
        return queue

    def unsubscribe(self, gateway_id: str, queue: asyncio.Queue) -> None:
        if self.streams.get(gateway_id) is queue:
            del self.streams[gateway_id]


def token_delta(sample, request: Request, num_new: int,
                logprobs: list[common_pb2.TokenLogprob]) -> scheduler_pb2.SequenceDelta:
    delta = scheduler_pb2.SequenceDelta(
        request_id=sample.parent.request_id, index=sample.index,
        new_token_ids=request.output_token_ids[len(request.output_token_ids) - num_new:],
        logprobs=logprobs)
    if request.num_output_tokens == num_new:  # the first delta of this sample
        delta.num_cached_prompt_tokens = request.num_cached_prompt_tokens
    if request.is_finished:
        delta.finish_reason = FINISH_REASONS[request.status]
        if request.stop_token_id is not None:
            delta.stop_token_id = request.stop_token_id
    return delta


def finish_delta(sample, reason: int, error: str = "") -> scheduler_pb2.SequenceDelta:
    return scheduler_pb2.SequenceDelta(request_id=sample.parent.request_id, index=sample.index,
                                       finish_reason=reason, error=error)
