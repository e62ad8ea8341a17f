"""Per-gateway outboxes at the service edge: the core emits its deltas during a step, and each
gateway's stream gets them as one OutputBatch per step."""
from __future__ import annotations

import asyncio
from collections import defaultdict

from kvrelay.api.kvrelay.v1 import scheduler_pb2
from kvrelay.scheduler.edge import delta_to_proto
from kvrelay.scheduler.messages import Delta


class DeltaSink:
    """`emit` buffers; `flush` sends each subscribed gateway one OutputBatch."""

    def __init__(self) -> None:
        self.pending: dict[str, list[Delta]] = defaultdict(list)
        self.streams: dict[str, asyncio.Queue] = {}

    def emit(self, gateway_id: str, delta: Delta) -> None:
        self.pending[gateway_id].append(delta)

    def flush(self) -> None:
        for gateway_id, deltas in self.pending.items():
            queue = self.streams.get(gateway_id)
            if queue is not None:
                queue.put_nowait(scheduler_pb2.OutputBatch(
                    deltas=[delta_to_proto(delta) for delta in deltas]))
        self.pending.clear()

    def subscribe(self, gateway_id: str) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        self.streams[gateway_id] = queue
        return queue

    def unsubscribe(self, gateway_id: str, queue: asyncio.Queue) -> None:
        if self.streams.get(gateway_id) is queue:
            del self.streams[gateway_id]
