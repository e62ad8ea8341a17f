"""The transport interface. A transport gets the order and an async feed of layers and must
either deliver every layer into the destination blocks or raise TransferFailed. A transport that
can write the destination itself (shm) may instead give the feed a lander, which writes the final
pages there in one pass; its push then reports how that went.

Keeping the unit of work "one layer of a set of blocks" leaves room for transports that move
device memory directly (RDMA / NCCL on GPUs): they would read the same feed of tensors.
"""
from __future__ import annotations

import time
from abc import ABC, abstractmethod

from kvrelay.step_messages import SendOrder
from kvrelay.worker.kv_connector.feed import Lander, LayerFeed


class TransferFailed(Exception):
    pass


def seconds_left(order: SendOrder) -> float:
    """Until the order's deadline (inf without one)."""
    if not order.deadline_unix_ms:
        return float("inf")
    return order.deadline_unix_ms / 1000 - time.time()


def check_deadline(order: SendOrder) -> None:
    """Before each write: past its deadline the scheduler may have lost track of this sender
    and given the destination blocks to another request."""
    if seconds_left(order) <= 0:
        raise TransferFailed("the order's deadline passed")


class KvTransport(ABC):
    name: str

    @abstractmethod
    async def push(self, order: SendOrder, feed: LayerFeed) -> int:
        """Deliver every layer of `feed` to order.dst_block_ids; return the bytes moved."""

    def lander(self, order: SendOrder) -> Lander | None:
        """What writes this send's final pages straight into the destination, or None: the
        transport reads the feed's layers."""
        return None

    async def close(self) -> None:
        pass
