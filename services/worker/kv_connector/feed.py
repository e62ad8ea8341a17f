"""One send's source pages: a stream of layers (layer index, KV tensor [2, num_blocks, block_size,
kv_heads, head_dim]) in layer order, produced by the compute thread or straight from the cache;
or, where the transport can write the destination itself (shm), one copy of the final pages
straight into it (`land`). A "layer" here is a slot of the cache's first dimension: a block
holds the pages of its KV group's layers in slots (engine/kv_groups.py), one slot per layer for
a model without windows."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import torch

from kvrelay.engine.kv_pages import KvPages

# Writes a send's final pages into their destination in one synchronous pass:
# (the source cache's pages, source block ids) -> bytes written. Raises on failure.
Lander = Callable[[KvPages, list[int]], int]


class LayerFeed:
    def __init__(self, kv_pages: KvPages, src_block_ids: list[int],
                 loop: asyncio.AbstractEventLoop, lander: Lander | None = None,
                 slots_done_after: dict[int, tuple[int, ...]] | None = None) -> None:
        self.kv_pages = kv_pages  # the source cache, every KV head (a group's too)
        # model layer -> the slots final once it ran (KVGroupLayout.slots_done_after);
        # None: slot i is layer i
        self.slots_done_after = slots_done_after
        self.src_block_ids = src_block_ids
        self.src_index = torch.tensor(src_block_ids, dtype=torch.int64)
        self.num_layers = kv_pages.num_slots
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()
        self.error: BaseException | None = None  # why the layers stopped coming, if they did
        # With a lander the final pages go straight to the destination, not copied out first
        # and then copied again by the transport; `landed` holds its outcome (bytes written).
        self.lander = lander
        self.has_landed = False
        self.landed: asyncio.Future = loop.create_future()
        self.landed.add_done_callback(_retrieve)  # a send that gave up first need not read it

    def gather(self, layer: int) -> torch.Tensor:
        """This layer's pages of the source blocks, copied out: [2, n, bs, kv_heads, head_dim]."""
        return self.kv_pages.read(layer, self.src_index)

    def on_layer_done(self, layer: int) -> None:
        """Called from the compute thread once model layer `layer`'s KV of the step is
        stored."""
        slots = (layer,) if self.slots_done_after is None else \
            self.slots_done_after.get(layer, ())
        for slot in slots:
            pages = self.gather(slot)
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (slot, pages))

    def fail(self, error: BaseException) -> None:
        """The forward pass failed: wake the consumer with the error."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (-1, error))
        if self.lander is not None:
            self.loop.call_soon_threadsafe(self._settle, None, error)

    def fill_now(self) -> None:
        """The KV is final (computed in an earlier step, or by the step just done): land it, or
        copy every layer out and queue it. Either way the pages have left the source blocks
        when this returns, so the scheduler may hand those to the next step. Event loop only."""
        if self.lander is not None:
            self.land()
            return
        for layer in range(self.num_layers):
            self.queue.put_nowait((layer, self.gather(layer)))

    def land(self) -> None:
        """With a lander, write the final pages to the destination now (any thread: the
        compute thread does it right after the forward pass); without one, nothing."""
        if self.lander is None or self.has_landed:
            return
        self.has_landed = True  # once, whichever of the compute thread and fill_now comes first
        try:
            outcome, error = self.lander(self.kv_pages, self.src_block_ids), None
        except Exception as exc:  # noqa: BLE001 - the transport reports it as the send's failure
            outcome, error = None, exc
        self.loop.call_soon_threadsafe(self._settle, outcome, error)

    def _settle(self, num_bytes: int | None, error: BaseException | None) -> None:
        if self.landed.done():
            return
        if error is not None:
            self.landed.set_exception(error)
        else:
            self.landed.set_result(num_bytes)

    async def layers(self):
        for _ in range(self.num_layers):
            layer, pages = await self.queue.get()
            if layer < 0:
                self.error = pages
                raise pages
            yield layer, pages


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()
