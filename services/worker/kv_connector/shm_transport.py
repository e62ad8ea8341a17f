"""KV pages copied straight into the decode worker's cache, mapped from a shared file (same
host only): no serialization and no extra process hop; the scheduler learns of completion from
this worker's result, and the decode worker reads the pages once told to decode."""
from __future__ import annotations

import torch

from services.api.kvrelay.v1 import worker_pb2
from services.engine.model_runner import map_kv_cache_file
from services.worker.kv_connector.base import KvTransport, TransferFailed, check_deadline
from services.worker.kv_connector.feed import LayerFeed


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

    async def push(self, order: worker_pb2.KvSendOrder, feed: LayerFeed) -> int:
        if not order.dst_shm_path:
            raise TransferFailed("shm transport needs the destination's shm path")
        destination = self._destination(order.dst_shm_path)
        dst_index = torch.tensor(list(order.dst_block_ids), dtype=torch.int64)
        if dst_index.numel() and int(dst_index.max()) >= destination.shape[2]:
            raise TransferFailed(f"destination block {int(dst_index.max())} out of range")
        num_bytes = 0
        async for layer, pages in feed.layers():  # pages [2, n, bs, kv_heads, head_dim]
            check_deadline(order)
            destination[layer].index_copy_(1, dst_index, pages)
            num_bytes += pages.numel() * pages.element_size()
        return num_bytes
