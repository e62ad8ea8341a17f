"""KV pages over a gRPC client stream to the decode worker's KvTransfer service (any host).

Each message carries one layer of some blocks and stays under gRPC's default 4 MiB limit, so the
receiver needs no special channel options.
"""
from __future__ import annotations

import asyncio

import grpc

from kvrelay.api.kvrelay.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc, worker_pb2
from kvrelay.common.grpc_server import channel
from kvrelay.worker.kv_connector.base import KvTransport, TransferFailed, check_deadline
from kvrelay.worker.kv_connector.feed import LayerFeed

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

    async def push(self, order: worker_pb2.KvSendOrder, feed: LayerFeed) -> int:
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

    async def _chunks(self, order: worker_pb2.KvSendOrder, feed: LayerFeed):
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


def _raw_bytes(tensor) -> bytes:
    # bfloat16 has no numpy dtype: view the bits as int16 to get at the bytes.
    import torch
    flat = tensor.contiguous()
    if flat.dtype == torch.bfloat16:
        flat = flat.view(torch.int16)
    return flat.numpy().tobytes()
