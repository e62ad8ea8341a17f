"""KV pages over a gRPC client stream to the decode worker's KvTransfer service (any host): the
sending end (`GrpcKvTransport`) and the receiving servicer (`KvTransferService`, which hands
the pages to the KvReceiver). This is the transport's wire code: kv_transfer.proto's messages
go no further.

Each message carries one layer of some blocks and stays under gRPC's default 4 MiB limit, so the
receiver needs no special channel options.
"""
from __future__ import annotations

import asyncio

import grpc

from kvrelay.api.kvrelay.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc
from kvrelay.common.grpc_server import channel
from kvrelay.step_messages import SendOrder
from kvrelay.worker.kv_connector.base import KvTransport, TransferFailed, check_deadline
from kvrelay.worker.kv_connector.feed import LayerFeed
from kvrelay.worker.kv_connector.receiver import KvReceiver, PageChunk

MAX_CHUNK_BYTES = 3 << 20  # K and V together, leaving room for the message's other fields


class GrpcKvTransport(KvTransport):
    name = "grpc"

    def __init__(self) -> None:
        self.stubs: dict[str, kv_transfer_pb2_grpc.KvTransferStub] = {}
        self.channels = []

    def _stub(self, address: str) -> kv_transfer_pb2_grpc.KvTransferStub:
        if address not in self.stubs:
            chan = channel(address, "worker")
            self.channels.append(chan)
            self.stubs[address] = kv_transfer_pb2_grpc.KvTransferStub(chan)
        return self.stubs[address]

    async def push(self, order: SendOrder, feed: LayerFeed) -> int:
        try:
            # wait_for_ready: a connection that dropped and is coming back (a network blip, a
            # restarting proxy) delays the push until the sender's deadline rather than failing
            # it at once, which would cost the sample a re-prefill and one of its retries.
            ack = await self._stub(order.dst_address).Push(self._chunks(order, feed),
                                                            wait_for_ready=True)
        except grpc.aio.AioRpcError as exc:
            raise TransferFailed(f"push to {order.dst_address} failed: {exc.code().name}: "
                                 f"{exc.details()}") from None
        except asyncio.CancelledError:
            # grpc.aio cancels the call when the request iterator raises (the forward pass that
            # feeds the layers failed); that is this send's failure, not a cancelled task.
            if feed.error is None or asyncio.current_task().cancelling():
                raise
            raise TransferFailed(f"the pages could not be read: {feed.error!r}") from None
        if not ack.ok:
            raise TransferFailed(f"receiver {order.dst_address} refused: {ack.error}")
        return ack.num_bytes

    async def _chunks(self, order: SendOrder, feed: LayerFeed):
        dst = list(order.dst_block_ids)
        async for layer, pages in feed.layers():  # pages [2, n, bs, kv_heads, head_dim]
            dtype = str(pages.dtype).removeprefix("torch.")
            block_bytes = pages[:, :1].numel() * pages.element_size()
            per_chunk = max(1, MAX_CHUNK_BYTES // block_bytes)
            for start in range(0, len(dst), per_chunk):
                part = pages[:, start:start + per_chunk]
                check_deadline(order)
                yield kv_transfer_pb2.KvChunk(
                    transfer_id=order.transfer_id, layer=layer,
                    dst_block_ids=dst[start:start + per_chunk],
                    keys=_raw_bytes(part[0]), values=_raw_bytes(part[1]), dtype=dtype,
                    deadline_unix_ms=order.deadline_unix_ms,
                    dst_instance_id=order.dst_instance_id,
                    last=layer == feed.num_layers - 1 and start + per_chunk >= len(dst))

    async def close(self) -> None:
        for chan in self.channels:
            await chan.close()


class KvTransferService(kv_transfer_pb2_grpc.KvTransferServicer):
    """The decode worker's end: each pushed stream's chunks go to the receiver as PageChunks."""

    def __init__(self, receiver: KvReceiver) -> None:
        self.receiver = receiver

    async def Push(self, request_iterator, context) -> kv_transfer_pb2.KvPushAck:
        outcome = await self.receiver.receive(
            chunk_from_proto(chunk) async for chunk in request_iterator)
        return kv_transfer_pb2.KvPushAck(transfer_id=outcome.transfer_id, ok=outcome.ok,
                                         error=outcome.error, num_bytes=outcome.num_bytes)


def chunk_from_proto(message: kv_transfer_pb2.KvChunk) -> PageChunk:
    """The page bytes are the message's own (no copy)."""
    return PageChunk(
        transfer_id=message.transfer_id, layer=message.layer,
        dst_block_ids=tuple(message.dst_block_ids), keys=message.keys, values=message.values,
        dtype=message.dtype, deadline_unix_ms=message.deadline_unix_ms,
        dst_instance_id=message.dst_instance_id, last=message.last)


def _raw_bytes(tensor) -> bytes:
    # numpy knows neither bfloat16 nor float8: view the elements as bytes to get at them.
    import torch
    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
