"""KV pages copied straight into the decode worker's cache, mapped from a shared file (same
host only): no serialization and no extra process hop; the scheduler learns of completion from
this worker's result, and the decode worker reads the pages once told to decode."""
from __future__ import annotations

import torch

from kvrelay.engine.model_runner import map_kv_cache_file
from kvrelay.kernels.kv_quant import byte_view
from kvrelay.step_messages import SendOrder
from kvrelay.worker.kv_connector.base import KvTransport, TransferFailed, check_deadline
from kvrelay.worker.kv_connector.feed import Lander, LayerFeed


class ShmKvTransport(KvTransport):
    name = "shm"

    def __init__(self, block_shape: tuple[int, int, int, int], dtype: torch.dtype) -> None:
        self.block_shape = block_shape  # (layers, block_size, kv_heads, head_dim)
        self.dtype = dtype
        self.mappings: dict[str, torch.Tensor] = {}

    def _destination(self, path: str) -> torch.Tensor:
        if path not in self.mappings:
            try:
                self.mappings[path] = map_kv_cache_file(path, self.dtype, self.block_shape)
            except OSError as exc:
                raise TransferFailed(f"cannot map {path}: {exc}") from None
        return self.mappings[path]

    def _target(self, order: SendOrder) -> tuple[torch.Tensor, list[int]]:
        """The destination's mapped cache and the order's block ids in it, checked."""
        if not order.dst_shm_path:
            raise TransferFailed("shm transport needs the destination's shm path")
        destination = self._destination(order.dst_shm_path)
        dst_block_ids = list(order.dst_block_ids)
        if dst_block_ids and max(dst_block_ids) >= destination.shape[2]:
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

        def land(kv_cache: torch.Tensor, src_block_ids: list[int]) -> int:
            # kv_cache, destination [layers, 2, num_blocks, block_size, kv_heads, head_dim]
            check_deadline(order)
            for src, dst in zip(src_block_ids, dst_block_ids):
                destination[:, :, dst].copy_(kv_cache[:, :, src])
            return len(dst_block_ids) * kv_cache[:, :, 0].numel() * kv_cache.element_size()
        return land

    async def push(self, order: SendOrder, feed: LayerFeed) -> int:
        if feed.lander is not None:
            return await feed.landed
        destination, dst_block_ids = self._target(order)
        dst_index = torch.tensor(dst_block_ids, dtype=torch.int64)
        num_bytes = 0
        async for layer, pages in feed.layers():  # pages [2, n, bs, kv_heads, head_dim]
            check_deadline(order)
            byte_view(destination[layer]).index_copy_(1, dst_index, byte_view(pages))
            num_bytes += pages.numel() * pages.element_size()
        return num_bytes


def _refusing(problem: TransferFailed) -> Lander:
    def refuse(kv_cache: torch.Tensor, src_block_ids: list[int]) -> int:
        raise problem
    return refuse
