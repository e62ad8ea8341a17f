"""One send's stream of layers: (layer index, KV tensor [2, num_blocks, block_size, kv_heads,
head_dim]) in layer order, produced by the compute thread or straight from the cache."""
from __future__ import annotations

import asyncio

import torch


class LayerFeed:
    def __init__(self, kv_cache: torch.Tensor, src_block_ids: list[int],
                 loop: asyncio.AbstractEventLoop) -> None:
        # kv_cache [layers, 2, num_blocks, block_size, kv_heads, head_dim]
        self.kv_cache = kv_cache
        self.src_index = torch.tensor(src_block_ids, dtype=torch.int64)
        self.num_layers = kv_cache.shape[0]
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.error: BaseException | None = None  # why the layers stopped coming, if they did

    def gather(self, layer: int) -> torch.Tensor:
        """This layer's pages of the source blocks, copied out: [2, n, bs, kv_heads, head_dim]."""
        return self.kv_cache[layer].index_select(1, self.src_index)

    def on_layer_done(self, layer: int) -> None:
        """Called from the compute thread once `layer`'s KV of the step is stored."""
        pages = self.gather(layer)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (layer, pages))

    def fail(self, error: BaseException) -> None:
        """The forward pass failed: wake the consumer with the error."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (-1, error))

    def fill_now(self) -> None:
        """The KV is already final (computed in an earlier step): queue every layer at once."""
        for layer in range(self.num_layers):
            self.queue.put_nowait((layer, self.gather(layer)))

    async def layers(self):
        for _ in range(self.num_layers):
            layer, pages = await self.queue.get()
            if layer < 0:
                self.error = pages
                raise pages
            yield layer, pages
