"""Fixed-size KV blocks: an LRU free queue, ref counts, and the prefix-cache hash table.

A freed block keeps its hash and stays findable until the free queue hands it out again, so a
later request with the same prefix can revive it. Blocks are freed tail-first, so the end of a
sequence is evicted before its (more shareable) beginning.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable


@dataclass(frozen=True, slots=True)
class BlockHash:
    """A full block's identity: the parent's hash value chains it to the whole prefix."""
    value: int
    token_ids: tuple[int, ...]
    parent_value: int | None


def hash_block(parent: BlockHash | None, token_ids: Iterable[int], extra_keys=None) -> BlockHash:
    tokens = tuple(token_ids)
    parent_value = parent.value if parent is not None else None
    return BlockHash(hash((parent_value, tokens, extra_keys)), tokens, parent_value)


class KVBlock:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "group", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.group = 0  # the KV group (kv_groups.py) whose pages it holds, while hashed
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        return f"KVBlock({self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list with sentinels: O(1) pop from the head, append, removal from the middle."""

    def __init__(self, blocks: list[KVBlock]) -> None:
        self._head = KVBlock(-1)
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVBlock:
        block = self._head.next_free
        if block is self._tail:
            raise RuntimeError("no free KV block")
        self.remove(block)
        return block

    def remove(self, block: KVBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def append(self, block: KVBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise RuntimeError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free += 1

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        # (KV group, hash value) -> block holding that prefix block: each group's layers have
        # their own pages for the same tokens, so groups never share a block
        self.cached: dict[tuple[int, int], KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def lookup(self, block_hash: BlockHash, group: int = 0) -> KVBlock | None:
        block = self.cached.get((group, block_hash.value))
        # Verify on hit: a hash collision must never hand out another prefix's KV.
        if block is None or block.block_hash != block_hash:
            return None
        return block

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        blocks = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cache hits, pulling unreferenced ones out of the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference each; pass blocks tail-first so tails are evicted first."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVBlock, block_hash: BlockHash, group: int = 0) -> None:
        if block.block_hash is not None:
            return
        block.block_hash = block_hash
        block.group = group
        # First writer wins: an identical block cached earlier keeps serving hits.
        self.cached.setdefault((group, block_hash.value), block)

    def _evict(self, block: KVBlock) -> None:
        if block.block_hash is None:
            return
        key = (block.group, block.block_hash.value)
        if self.cached.get(key) is block:
            del self.cached[key]
        block.block_hash = None