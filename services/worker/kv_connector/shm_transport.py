"""KV pages copied straight into the decode worker's cache, mapped from a shared file (same
host only): no serialization and no extra process hop; the scheduler learns of completion from
this worker's result, and the decode worker reads the pages once told to decode."""
from __future__ import annotations

import torch

from kvrelay.engine.kv_pages import KvPages, map_kv_pages
from kvrelay.step_messages import SendOrder
from kvrelay.worker.kv_connector.base import KvTransport, TransferFailed, check_deadline
from kvrelay.worker.kv_connector.feed import Lander, LayerFeed


class ShmKvTransport(KvTransport):
    name = "shm"

    def __init__(self, block_shape: tuple[int, int, int, int], dtype: torch.dtype) -> None:
        # (layer slots, block_size, the model's KV heads, row_width)
        self.block_shape = block_shape
        self.dtype = dtype
        self.mappings: dict[tuple[str, int], KvPages] = {}

    def _destination(self, path: str, num_shards: int) -> KvPages:
        """The destination's cache file mapped, cut as its group of num_shards ranks cuts it."""
        key = (path, num_shards)
        if key not in self.mappings:
            try:
                self.mappings[key] = map_kv_pages(path, self.dtype, self.block_shape,
                                                  num_shards)
            except OSError as exc:
                raise TransferFailed(f"cannot map {path}: {exc}") from None
        return self.mappings[key]

    def _target(self, order: SendOrder) -> tuple[KvPages, list[int]]:
        """The destination's mapped cache and the order's block ids in it, checked."""
        if not order.dst_shm_path:
            raise TransferFailed("shm transport needs the destination's shm path")
        destination = self._destination(order.dst_shm_path, order.dst_kv_shards)
        dst_block_ids = list(order.dst_block_ids)
        if dst_block_ids and max(dst_block_ids) >= destination.num_blocks:
            raise TransferFailed(f"destination block {max(dst_block_ids)} out of range")
        if len(dst_block_ids) != len(order.src_block_ids):
            raise TransferFailed(f"{len(order.src_block_ids)} source blocks for "
                                 f"{len(dst_block_ids)} destination blocks")
        return destination, dst_block_ids

    def lander(self, order: SendOrder) -> Lander:
        """Copies the final pages block by block, every layer at once, from the source cache
        into the mapped destination: one pass over the bytes, where copying each layer out
        and then in made two (and the second ran on the event loop during the next step)."""
        try:
            destination, dst_block_ids = self._target(order)
        except TransferFailed as problem:
            return _refusing(problem)  # the send fails when it would land

        def land(source: KvPages, src_block_ids: list[int]) -> int:
            check_deadline(order)
            return destination.copy_blocks_from(source, src_block_ids, dst_block_ids)
        return land

    async def push(self, order: SendOrder, feed: LayerFeed) -> int:
        if feed.lander is not None:
            return await feed.landed
        destination, dst_block_ids = self._target(order)
        dst_index = torch.tensor(dst_block_ids, dtype=torch.int64)
        num_bytes = 0
        async for layer, pages in feed.layers():  # pages [2, n, bs, kv_heads, head_dim]
            check_deadline(order)
            destination.write(layer, 0, dst_index, pages[0])
            destination.write(layer, 1, dst_index, pages[1])
            num_bytes += pages.numel() * pages.element_size()
        return num_bytes


def _refusing(problem: TransferFailed) -> Lander:
    def refuse(source: KvPages, src_block_ids: list[int]) -> int:
        raise problem
    return refuse
