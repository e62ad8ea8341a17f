"""The transport interface. A transport gets the order and an async feed of layers and must
either deliver every layer into the destination blocks or raise TransferFailed.

Keeping the unit of work "one layer of a set of blocks" leaves room for transports that move
device memory directly (RDMA / NCCL on GPUs): they would read the same feed of tensors.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

from services.api.kvrelay.v1 import worker_pb2
from services.worker.kv_connector.feed import LayerFeed


class TransferFailed(Exception):
    pass


class KvTransport(ABC):
    name: str

    @abstractmethod
    async def push(self, order: worker_pb2.KvSendOrder, feed: LayerFeed) -> int:
        """Deliver every layer of `feed` to order.dst_block_ids; return the bytes moved."""

    async def close(self) -> None:
        pass
