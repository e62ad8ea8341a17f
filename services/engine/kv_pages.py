"""A worker's KV cache as the KV connector reads and writes it: pages holding every KV head of
the model, whatever the cache is cut into.

One rank holds its cache whole. A tensor-parallel group's cache is cut by KV head: each rank's
shard is a contiguous cache of its own heads (every kernel reads contiguous caches), laid out
one after the other in a shared file the group's leader maps whole (parallel/group_kv.py). The
leader reads a page by joining its heads from the shards and writes one by cutting it, so a page
on the wire always holds all of the model's KV heads: a prefill group and a decode group of
different sizes exchange pages with no agreement beyond the model. Where ranks outnumber KV
heads a head lives on several ranks: it is read from the first and written to all.
"""
from __future__ import annotations

import os

import torch

from kvrelay.engine import shared_pages
from kvrelay.engine.parallel.shard import group_kv_heads
from kvrelay.kernels.kv_quant import byte_view


class KvPages:
    def __init__(self, shards: list[torch.Tensor], heads_of: list[list[int]]) -> None:
        # shards[r] [slots, 2, num_blocks, block_size, len(heads_of[r]), row_width]
        self.shards = shards
        self.heads_of = heads_of  # the model's KV heads each shard holds, in order
        self.num_heads = 1 + max(max(heads) for heads in heads_of)
        # Reading: for each run of heads, the shard it is read from and its heads there.
        self.read_runs = _runs(heads_of, self.num_heads)

    @classmethod
    def whole(cls, kv_cache: torch.Tensor) -> KvPages:
        """One rank's cache, every head in it."""
        return cls([kv_cache], [list(range(kv_cache.shape[4]))])

    @property
    def num_slots(self) -> int:
        return self.shards[0].shape[0]

    @property
    def num_blocks(self) -> int:
        return self.shards[0].shape[2]

    @property
    def dtype(self) -> torch.dtype:
        return self.shards[0].dtype

    @property
    def page_shape(self) -> tuple[int, int, int]:
        """(block_size, the model's KV heads, row_width): one layer slot's K (or V) of a block."""
        block_size, _, row_width = self.shards[0].shape[3:]
        return block_size, self.num_heads, row_width

    @property
    def block_bytes(self) -> int:
        """One block's pages of every slot, K and V, every head."""
        block_size, heads, row_width = self.page_shape
        return (self.num_slots * 2 * block_size * heads * row_width
                * self.shards[0].element_size())

    def read(self, slot: int, block_index: torch.Tensor) -> torch.Tensor:
        """Slot `slot`'s pages of the blocks, copied out: [2, n, block_size, heads, row_width]."""
        parts = [byte_view(self.shards[shard][slot]).index_select(1, block_index)[..., lo:hi, :]
                 for shard, lo, hi in self.read_runs]
        pages = parts[0] if len(parts) == 1 else torch.cat(parts, dim=3)
        return pages.view(self.dtype) if pages.dtype != self.dtype else pages

    def write(self, slot: int, kv: int, block_index: torch.Tensor,
              pages: torch.Tensor) -> None:
        """Write K (kv 0) or V (kv 1) of slot `slot` into the blocks; pages [n, block_size,
        heads, row_width] in the cache's dtype."""
        source = byte_view(pages)
        for shard, heads in zip(self.shards, self.heads_of):
            byte_view(shard[slot, kv]).index_copy_(0, block_index, _heads(source, heads, 2))

    def copy_blocks_from(self, source: KvPages, src_ids: list[int], dst_ids: list[int]) -> int:
        """Every slot's pages of source's blocks into these blocks, pair by pair; the bytes
        written (counting each head once)."""
        for src, dst in zip(src_ids, dst_ids):
            block = source.block(src)  # [slots, 2, block_size, heads, row_width]
            for shard, heads in zip(self.shards, self.heads_of):
                byte_view(shard[:, :, dst]).copy_(_heads(byte_view(block), heads, 3))
        return len(dst_ids) * self.block_bytes

    def block(self, block_id: int) -> torch.Tensor:
        """Every slot's pages of one block, every head: [slots, 2, block_size, heads,
        row_width]; a view where one shard holds them all."""
        parts = [self.shards[shard][:, :, block_id, :, lo:hi] for shard, lo, hi in self.read_runs]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([byte_view(part) for part in parts], dim=3).view(self.dtype)


def map_kv_pages(path: str, dtype: torch.dtype, block_shape: tuple[int, int, int, int],
                 num_shards: int = 1) -> KvPages:
    """Another worker's shared KV cache file as pages of every head. block_shape (slots,
    block_size, the model's KV heads, row_width); num_shards: the ranks of the group it is cut
    for (1: one worker's whole cache). The block count follows from the file's size."""
    slots, block_size, num_kv_heads, row_width = block_shape
    heads_of = group_kv_heads(num_kv_heads, num_shards)
    element_size = torch.tensor([], dtype=dtype).element_size()
    num_bytes = os.stat(path).st_size
    region_bytes = num_bytes // num_shards
    block_bytes = slots * 2 * block_size * len(heads_of[0]) * row_width * element_size
    num_blocks = region_bytes // block_bytes
    whole = torch.from_file(path, shared=True, size=num_bytes, dtype=torch.uint8)
    shared_pages.populate(whole)  # the owner committed them: map them all now, not in a send
    shards = [whole[r * region_bytes:r * region_bytes + num_blocks * block_bytes]
              .view(dtype).view(slots, 2, num_blocks, block_size, len(heads), row_width)
              for r, heads in enumerate(heads_of)]
    return KvPages(shards, heads_of)


def _heads(pages: torch.Tensor, heads: list[int], dim: int) -> torch.Tensor:
    """The given heads of pages along `dim`, a view where they are a run."""
    if heads == list(range(heads[0], heads[0] + len(heads))):
        return pages.narrow(dim, heads[0], len(heads))
    return pages.index_select(dim, torch.tensor(heads, dtype=torch.int64))


def _runs(heads_of: list[list[int]], num_heads: int) -> list[tuple[int, int, int]]:
    """(shard, first, last + 1) positions within the shard, covering heads 0..num_heads-1 in
    order, each head read from the first shard holding it."""
    owner = {}
    for shard, heads in enumerate(heads_of):
        for position, head in enumerate(heads):
            owner.setdefault(head, (shard, position))
    runs: list[tuple[int, int, int]] = []
    for head in range(num_heads):
        if head not in owner:
            raise ValueError(f"KV head {head} is in no shard")
        shard, position = owner[head]
        if runs and runs[-1][0] == shard and runs[-1][2] == position:
            runs[-1] = (shard, runs[-1][1], position + 1)
        else:
            runs.append((shard, position, position + 1))
    return runs
