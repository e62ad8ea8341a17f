"""One scheduler group (a scheduler with its own workers) as one gateway sees it; its calls are
the gateway's edge to the scheduler (messages converted by edge.py).

Several groups behind the gateways give data parallelism: each request goes, whole, to the
group with the least load. A group's load comes from its Stats (polled) plus what this gateway
sent it since, so a burst that arrives between two polls still spreads over the groups."""
from __future__ import annotations

import asyncio

import grpc

from kvrelay.api.kvrelay.v1 import scheduler_pb2, scheduler_pb2_grpc
from kvrelay.common.grpc_server import channel
from kvrelay.common.log import get_logger, request_metadata
from kvrelay.gateway.edge import OutputsStream, stats_from_proto, submit_requests
from kvrelay.gateway.errors import from_rpc_error
from kvrelay.gateway.messages import Generation, SchedulerStats

log = get_logger(__name__)

PROBE_TIMEOUT_S = 2.0
CALL_TIMEOUT_S = 60.0  # a unary call that has not answered in this long will not
LOAD_TIMEOUT_S = 300.0  # a LoRA load reads and checks the adapter on every worker


class SchedulerGroup:
    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = channel(address, "scheduler")
        self.stub = scheduler_pb2_grpc.SchedulerStub(self.channel)
        self.stats: SchedulerStats | None = None
        self.outputs_connected = False
        self.submitted_since_stats = 0  # requests sent after the last Stats answer
        # Scheduler ids to abort here, kept (in order, once each) until an Abort call took
        # them: while the Outputs stream is down they wait for it to be back.
        self.pending_aborts: dict[str, None] = {}

    @property
    def ready(self) -> bool:
        return self.outputs_connected and self.stats is not None and self.stats.ready

    def load(self) -> tuple[float, float]:
        """(sequences per worker, fraction of KV blocks in use): lower is freer."""
        stats = self.stats
        if stats is None:
            return (float("inf"), 1.0)
        num_sequences = stats.num_waiting + stats.num_running + self.submitted_since_stats
        num_blocks = sum(w.num_blocks for w in stats.workers)
        used_blocks = sum(w.num_blocks - w.num_free_blocks for w in stats.workers)
        return (num_sequences / max(1, len(stats.workers)), used_blocks / max(1, num_blocks))

    async def close(self) -> None:
        await self.channel.close()

    async def submit(self, generation: Generation) -> None:
        """One Submit per prompt, all at once; raises the first refusal once all answered."""
        self.submitted_since_stats += len(generation.prompts)
        metadata = request_metadata(generation.client_request_id)
        results = await asyncio.gather(
            *(self.stub.Submit(request, metadata=metadata, timeout=CALL_TIMEOUT_S)
              for request in submit_requests(generation)), return_exceptions=True)
        for result in results:
            if isinstance(result, grpc.RpcError):
                raise from_rpc_error(result, "scheduler") from None
            if isinstance(result, BaseException):
                raise result

    async def abort(self, ids: list[str]) -> list[str]:
        reply = await self.stub.Abort(scheduler_pb2.SchedulerAbortRequest(request_ids=ids),
                                      timeout=PROBE_TIMEOUT_S)
        return list(reply.aborted)

    def queue_aborts(self, ids: list[str]) -> None:
        self.pending_aborts.update(dict.fromkeys(ids))

    async def send_aborts(self) -> bool:
        """Send the queued aborts, if the Outputs stream is up; False when the call failed
        (they stay queued for the next try).

        Sent only over a registered stream: one that is down may be half-open, its requests
        still computing at the scheduler while it has not noticed, or noticed only after a new
        stream of ours registered (then its `_abort_gateway` leaves them alone). An id aborted
        twice, or one the scheduler (restarted) never knew, is ignored there, and ids are never
        reused, so a late abort ends nothing else."""
        ids = list(self.pending_aborts)
        if not ids or not self.outputs_connected:
            return True
        try:
            await self.abort(ids)
        except grpc.RpcError as exc:
            log.warning("abort failed, kept to retry", scheduler=self.address,
                        num_requests=len(ids), error=exc.code().name)
            return False
        for request_id in ids:  # those queued during the call wait for the next one
            self.pending_aborts.pop(request_id, None)
        return True

    async def refresh_stats(self) -> None:
        submitted_before = self.submitted_since_stats  # these the answer will count
        try:
            self.stats = stats_from_proto(await self.stub.Stats(scheduler_pb2.StatsRequest(),
                                                                timeout=PROBE_TIMEOUT_S))
        except grpc.RpcError:
            self.stats = None
        self.submitted_since_stats -= submitted_before

    async def load_adapter(self, name: str, path: str) -> None:
        """GatewayError with the scheduler's reason where the group cannot serve it."""
        try:
            await self.stub.LoadAdapter(scheduler_pb2.SchedulerLoadAdapterRequest(
                name=name, path=path), timeout=LOAD_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, "scheduler") from None
        await self.refresh_stats()  # requests naming it may come at once

    async def unload_adapter(self, name: str) -> None:
        try:
            await self.stub.UnloadAdapter(scheduler_pb2.SchedulerUnloadAdapterRequest(
                name=name), timeout=LOAD_TIMEOUT_S)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, "scheduler") from None
        await self.refresh_stats()

    def outputs(self, gateway_id: str) -> OutputsStream:
        return OutputsStream(self.stub.Outputs(scheduler_pb2.OutputsRequest(gateway_id=gateway_id),
                                               wait_for_ready=True))


def least_loaded(groups: list[SchedulerGroup]) -> SchedulerGroup | None:
    ready = [group for group in groups if group.ready]
    return min(ready, key=SchedulerGroup.load) if ready else None
