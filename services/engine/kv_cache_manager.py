"""Per-request block tables on top of the BlockPool, with prefix-cache lookups.

A request's full blocks are hashed on (parent hash, token ids, cache salt). Blocks are registered
in the cache as soon as the scheduled tokens fill them: every token of a step's batch has its KV
stored before any attention of that layer reads it, so a request admitted in the same step may
already share them.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvrelay.engine.block_pool import BlockHash, BlockPool, KVBlock, hash_block
from kvrelay.engine.request import Request


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found in the cache

class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.req_num_cached: dict[str, int] = {}  # leading blocks already registered in the cache
        # PD decode side: hash value -> a reserved block whose pushed pages have not landed yet
        self.landing: dict[int, KVBlock] = {}
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, sequence_id: str) -> list[int]:
        return [block.block_id for block in self.req_blocks.get(sequence_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest cached prefix of a waiting request, leaving at least one token to compute."""
        hashes = self._hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in hashes[:max_hit_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup. Not every lookup: a request that does not fit
        yet is looked up again at every step until it does."""
        if self.enable_prefix_caching:
            self.stats.queries += num_tokens
            self.stats.hits += num_hit_tokens

    def num_cached_blocks(self, token_ids: list[int], cache_salt: str | None = None) -> int:
        """Leading full blocks of `token_ids` in the cache, without touching them (placement)."""
        if not self.enable_prefix_caching:
            return 0
        parent, count = None, 0
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = hash_block(parent, token_ids[start:start + self.block_size], cache_salt)
            if self.pool.lookup(parent) is None:
                break
            count += 1
        return count

    def can_fit(self, request: Request, num_new_tokens: int,
                computed_blocks: list[KVBlock] = ()) -> bool:
        return self._num_blocks_needed(request, num_new_tokens, computed_blocks) <= \
            self.pool.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] = (), register: bool = True) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens; False if they do not fit.
        register=False: the full blocks join the cache later (register_landed)."""
        if not self.can_fit(request, num_new_tokens, computed_blocks):
            return False
        blocks = self.req_blocks.setdefault(request.sequence_id, [])
        self.pool.touch(computed_blocks)
        blocks.extend(computed_blocks)
        num_tokens = (request.num_computed_tokens + len(computed_blocks) * self.block_size
                      + num_new_tokens)
        num_missing = -(-num_tokens // self.block_size) - len(blocks)
        if num_missing > 0:
            blocks.extend(self.pool.allocate(num_missing))
        if register:
            self._cache_full_blocks(request, num_tokens)
        return True

    # ---- PD decode side: sequences whose KV another worker pushes ------------------------------
    def allocate_for_transfer(self, request: Request) -> int | None:
        """Blocks for the request's tokens (a prompt, and a recovered sample's earlier outputs),
        whose pages a prefill worker will push. Leading blocks this cache already holds are
        shared and need no push; full blocks that another reservation waits for are shared too,
        and their pages still need a push (from this order, or from the other one when both go
        out in one step: TransferBook._share_pushes). Returns how many leading blocks need no
        push (at least one block always does), or None if the blocks do not fit."""
        hashes = self._hashes(request)
        num_tokens = request.num_tokens
        num_full = num_tokens // self.block_size
        landed = self._leading(hashes[:(num_tokens - 1) // self.block_size], self.pool.lookup)
        in_flight = self._leading(hashes[len(landed):num_full],
                                  lambda block_hash: self.landing.get(block_hash.value))
        shared = landed + in_flight
        num_new_tokens = num_tokens - len(shared) * self.block_size
        if not self.allocate_slots(request, num_new_tokens, shared, register=False):
            return None
        blocks = self.req_blocks[request.sequence_id]
        for index in range(len(shared), num_full):
            self.landing.setdefault(hashes[index].value, blocks[index])
        self.req_num_cached[request.sequence_id] = len(landed)
        return len(landed)

    def register_landed(self, request: Request) -> None:
        """The pushed pages are in: the full blocks of the request's tokens (those it was
        reserved for) now serve prefix hits."""
        self._drop_landing(request.sequence_id)
        self._cache_full_blocks(request, request.num_tokens)

    def set_aside(self, request: Request) -> list[KVBlock]:
        """Take a reservation's blocks out of its table, still referenced: a lost sender may
        still write into them (see release)."""
        self._drop_landing(request.sequence_id)
        self.req_hashes.pop(request.sequence_id, None)
        self.req_num_cached.pop(request.sequence_id, None)
        return self.req_blocks.pop(request.sequence_id, [])

    def release(self, blocks: list[KVBlock]) -> None:
        self.pool.free(reversed(blocks))

    @staticmethod
    def _leading(hashes: list[BlockHash], find) -> list[KVBlock]:
        blocks = []
        for block_hash in hashes:
            block = find(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def _drop_landing(self, sequence_id: str) -> None:
        if not self.landing:
            return
        for block, block_hash in zip(self.req_blocks.get(sequence_id, ()),
                                     self.req_hashes.get(sequence_id, ())):
            if self.landing.get(block_hash.value) is block:
                del self.landing[block_hash.value]

    def free(self, request: Request) -> None:
        self._drop_landing(request.sequence_id)
        blocks = self.req_blocks.pop(request.sequence_id, [])
        self.pool.free(reversed(blocks))
        self.req_num_cached.pop(request.sequence_id, None)

    def forget(self, request: Request) -> None:
        """Drop the per-request hash memo once a request is finished for good."""
        self.free(request)
        self.req_hashes.pop(request.sequence_id, None)

    def _num_blocks_needed(self, request: Request, num_new_tokens: int,
                           computed_blocks) -> int:
        held = len(self.req_blocks.get(request.sequence_id, ()))
        num_tokens = (request.num_computed_tokens + len(computed_blocks) * self.block_size
                      + num_new_tokens)
        new_blocks = max(0, -(-num_tokens // self.block_size) - held - len(computed_blocks))
        # A hit on a block nobody references takes it out of the free queue too.
        revived = sum(1 for block in computed_blocks if block.ref_cnt == 0)
        return new_blocks + revived

    def _hashes(self, request: Request) -> list[BlockHash]:
        hashes = self.req_hashes.setdefault(request.sequence_id, [])
        num_full = request.num_tokens // self.block_size
        tokens = request.all_token_ids
        while len(hashes) < num_full:
            start = len(hashes) * self.block_size
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tokens[start:start + self.block_size],
                                     request.cache_salt))
        return hashes

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        first = self.req_num_cached.get(request.sequence_id, 0)
        if num_full <= first:
            return
        hashes = self._hashes(request)
        blocks = self.req_blocks[request.sequence_id]
        for index in range(first, num_full):
            self.pool.cache_block(blocks[index], hashes[index])
        self.req_num_cached[request.sequence_id] = num_full
