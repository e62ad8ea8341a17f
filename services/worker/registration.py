"""Registers this worker with the scheduler and keeps its lease alive with heartbeats. A
scheduler that restarted (or forgot us) answers `known=False`, and we register again."""
from __future__ import annotations

import asyncio

import grpc

from kvrelay.api.kvrelay.v1 import scheduler_pb2, scheduler_pb2_grpc
from kvrelay.common.grpc_server import channel
from kvrelay.common.log import get_logger

log = get_logger(__name__)
RETRY_S = 1.0


class Registration:
    def __init__(self, scheduler_address: str, request: scheduler_pb2.RegisterWorkerRequest):
        self.channel = channel(scheduler_address, "scheduler")
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.request = request
        self.draining = False
        self.lease_s = 5.0

    async def keep_alive(self) -> None:
        registered = False
        while True:
            try:
                if not registered and self.draining:
                    return  # retired by the scheduler: do not join again
                if not registered:
                    response = await self.stub.RegisterWorker(self.request, timeout=10)
                    self.lease_s = response.lease_ms / 1000
                    registered = True
                    log.info("registered", scheduler_lease_s=self.lease_s)
                heartbeat = scheduler_pb2.HeartbeatRequest(worker_id=self.request.worker_id,
                                                           draining=self.draining)
                reply = await self.stub.Heartbeat(heartbeat, timeout=self.lease_s)
                registered = reply.known
                await asyncio.sleep(self.lease_s / 4)
            except grpc.aio.AioRpcError as exc:
                log.warning("scheduler unreachable", code=exc.code().name)
                registered = False
                await asyncio.sleep(RETRY_S)

    async def close(self) -> None:
        await self.channel.close()
