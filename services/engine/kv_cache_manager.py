"""Per-request block tables on top of the BlockPool, with prefix-cache lookups.

A request's full blocks are hashed on (parent hash, token ids, cache salt and LoRA adapter). Blocks are registered
in the cache as soon as the scheduled tokens fill them: every token of a step's batch has its KV
stored before any attention of that layer reads it, so a request admitted in the same step may
already share them.

The model's layers come in KV groups (kv_groups.py), each with its own block table per request
and its own cache entries; a window group's blocks that no later query can see are freed while
the request runs (free_out_of_window), their table entries left as placeholders.
"""
from __future__ import annotations

from dataclasses import dataclass

from kvrelay.engine.block_pool import BlockHash, BlockPool, KVBlock, hash_block
from kvrelay.engine.prefix_hits import CachedPrefix, first_in_window, longest_prefix
from kvrelay.engine.request import Request

# A table entry freed out of a group's window: any valid id, since attention never reads a block
# wholly before its window.
PLACEHOLDER_BLOCK_ID = 0


@dataclass(slots=True)
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found in the cache

class KVCacheManager:
    """group_windows: per KV group, its window (0: full attention); one group by default."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool,
                 group_windows: tuple[int, ...] = (0,)) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(group_windows)
        self.pool = BlockPool(num_blocks)
        # per request, per group: its blocks by position (None: freed out of the window)
        self.req_blocks: dict[str, list[list[KVBlock | None]]] = {}
        self.req_hashes: dict[str, list[BlockHash]] = {}
        self.req_num_cached: dict[str, int] = {}  # leading blocks already registered in the cache
        self.req_num_dropped: dict[str, list[int]] = {}  # per group: leading entries freed
        # PD decode side: (group, hash value) -> a reserved block whose pushed pages have not
        # landed yet
        self.landing: dict[tuple[int, int], KVBlock] = {}
        self.stats = PrefixCacheStats()
        self.num_window_freed = 0  # blocks freed out of a window while their request ran

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, sequence_id: str) -> list[list[int]]:
        """Per group, the request's block table (placeholders where freed)."""
        tables = self.req_blocks.get(sequence_id)
        if tables is None:
            return [[] for _ in self.windows]
        return [[PLACEHOLDER_BLOCK_ID if block is None else block.block_id for block in table]
                for table in tables]

    def num_held_blocks(self, sequence_id: str) -> int:
        """Blocks the request holds, over all groups."""
        return sum(len(table) - dropped for table, dropped in
                   zip(self.req_blocks.get(sequence_id, ()),
                       self.req_num_dropped.get(sequence_id, ())))

    def held_blocks(self, sequence_id: str) -> list[KVBlock]:
        """Every block the request holds, group after group, each group's in table order."""
        return [block for table in self.req_blocks.get(sequence_id, ()) for block in table
                if block is not None]

    def get_computed_blocks(self, request: Request) -> CachedPrefix:
        """The longest cached prefix of a waiting request, leaving at least one token to compute."""
        hashes = self._hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        return longest_prefix(hashes[:max_hit_blocks], self.windows, self.block_size,
                              self.pool.lookup)

    def record_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup. Not every lookup: a request that does not fit
        yet is looked up again at every step until it does."""
        if self.enable_prefix_caching:
            self.stats.queries += num_tokens
            self.stats.hits += num_hit_tokens

    def num_cached_blocks(self, token_ids: list[int], cache_key=None) -> int:
        """Leading full blocks of `token_ids` in the cache, without touching them (placement)."""
        if not self.enable_prefix_caching:
            return 0
        hashes, parent = [], None
        for start in range(0, len(token_ids) - self.block_size + 1, self.block_size):
            parent = hash_block(parent, token_ids[start:start + self.block_size], cache_key)
            hashes.append(parent)
        return longest_prefix(hashes, self.windows, self.block_size,
                              self.pool.lookup).num_blocks

    def can_fit(self, request: Request, num_new_tokens: int,
                computed: CachedPrefix | None = None) -> bool:
        return self._num_blocks_needed(request, num_new_tokens, computed) <= \
            self.pool.num_free_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed: CachedPrefix | None = None, register: bool = True) -> bool:
        """Give the request blocks for `num_new_tokens` more tokens (after its cached prefix
        `computed`, if any) in every group; False if they do not fit.
        register=False: the full blocks join the cache later (register_landed)."""
        if not self.can_fit(request, num_new_tokens, computed):
            return False
        sequence_id = request.sequence_id
        tables = self.req_blocks.get(sequence_id)
        if tables is None:
            tables = self.req_blocks[sequence_id] = [[] for _ in self.windows]
            self.req_num_dropped[sequence_id] = [0] * self.num_groups
        num_hit_tokens = 0
        if computed is not None:
            num_hit_tokens = computed.num_blocks * self.block_size
            self._take_prefix(sequence_id, tables, computed)
        num_tokens = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_needed = -(-num_tokens // self.block_size)
        for table in tables:  # (after every hit is touched: allocation evicts free blocks)
            if num_needed > len(table):
                table.extend(self.pool.allocate(num_needed - len(table)))
        if register:
            self._cache_full_blocks(request, num_tokens)
        return True

    def _take_prefix(self, sequence_id: str, tables: list[list[KVBlock | None]],
                     computed: CachedPrefix) -> None:
        dropped = self.req_num_dropped[sequence_id]
        for group, (table, blocks) in enumerate(zip(tables, computed.blocks)):
            self.pool.touch(block for block in blocks if block is not None)
            if not table:  # leading entries out of the window: dropped from the start
                dropped[group] = next((index for index, block in enumerate(blocks)
                                       if block is not None), len(blocks))
            table.extend(blocks)

    def free_out_of_window(self, request: Request) -> int:
        """Free the request's window-group blocks that no query after its computed tokens can
        see (they stay in the prefix cache until reused); returns how many."""
        tables = self.req_blocks.get(request.sequence_id)
        if tables is None:
            return 0
        dropped = self.req_num_dropped[request.sequence_id]
        num_freed = 0
        for group, window in enumerate(self.windows):
            if not window:
                continue
            table = tables[group]
            first = min(first_in_window(request.num_computed_tokens, window, self.block_size),
                        len(table))
            if first <= dropped[group]:
                continue
            doomed = [block for block in table[dropped[group]:first] if block is not None]
            table[dropped[group]:first] = [None] * (first - dropped[group])
            dropped[group] = first
            self.pool.free(reversed(doomed))
            num_freed += len(doomed)
        self.num_window_freed += num_freed
        return num_freed

    # ---- PD decode side: sequences whose KV another worker pushes ------------------------------
    def allocate_for_transfer(self, request: Request) -> int | None:
        """Blocks for the request's tokens (a prompt, and a recovered sample's earlier outputs),
        whose pages a prefill worker will push; a window group gets only the blocks its window
        reaches from the next token. Leading blocks this cache already holds are
        shared and need no push; full blocks that another reservation waits for are shared too,
        and their pages still need a push (from this order, or from the other one when both go
        out in one step: TransferBook._share_pushes). Returns how many leading blocks need no
        push (at least one block always does), or None if the blocks do not fit."""
        hashes = self._hashes(request)
        num_tokens = request.num_tokens
        num_full = num_tokens // self.block_size
        landed = longest_prefix(hashes[:(num_tokens - 1) // self.block_size], self.windows,
                                self.block_size, self.pool.lookup)
        shared = self._in_flight(landed, hashes[:num_full], num_tokens)
        for group, window in enumerate(self.windows):  # out of the window: never pushed
            blocks = shared.blocks[group]
            first = first_in_window(num_tokens, window, self.block_size)
            blocks[:first] = [None] * first
        num_new_tokens = num_tokens - shared.num_blocks * self.block_size
        if not self.allocate_slots(request, num_new_tokens, shared, register=False):
            return None
        for group, table in enumerate(self.req_blocks[request.sequence_id]):
            for index in range(len(shared.blocks[group]), num_full):
                self.landing.setdefault((group, hashes[index].value), table[index])
        self.req_num_cached[request.sequence_id] = landed.num_blocks
        return landed.num_blocks

    def _in_flight(self, landed: CachedPrefix, hashes: list[BlockHash],
                   num_tokens: int) -> CachedPrefix:
        """`landed`, extended by the full blocks after it that other reservations wait for in
        every group that needs them."""
        blocks = [list(group_blocks) for group_blocks in landed.blocks]
        firsts = [first_in_window(num_tokens, window, self.block_size)
                  for window in self.windows]
        index = landed.num_blocks
        while index < len(hashes):
            row = [None if index < first else self.landing.get((group, hashes[index].value))
                   for group, first in enumerate(firsts)]
            if any(block is None and index >= first for block, first in zip(row, firsts)):
                break
            for group_blocks, block in zip(blocks, row):
                group_blocks.append(block)
            index += 1
        return CachedPrefix(blocks, index)

    def register_landed(self, request: Request) -> None:
        """The pushed pages are in: the full blocks of the request's tokens (those it was
        reserved for) now serve prefix hits."""
        self._drop_landing(request.sequence_id)
        self._cache_full_blocks(request, request.num_tokens)

    def set_aside(self, request: Request) -> list[KVBlock]:
        """Take a reservation's blocks out of its tables, still referenced: a lost sender may
        still write into them (see release)."""
        self._drop_landing(request.sequence_id)
        self.req_hashes.pop(request.sequence_id, None)
        self.req_num_cached.pop(request.sequence_id, None)
        held = self.held_blocks(request.sequence_id)
        self.req_blocks.pop(request.sequence_id, None)
        self.req_num_dropped.pop(request.sequence_id, None)
        return held

    def release(self, blocks: list[KVBlock]) -> None:
        self.pool.free(reversed(blocks))

    def _drop_landing(self, sequence_id: str) -> None:
        if not self.landing:
            return
        hashes = self.req_hashes.get(sequence_id, ())
        for group, table in enumerate(self.req_blocks.get(sequence_id, ())):
            for block, block_hash in zip(table, hashes):
                key = (group, block_hash.value)
                if block is not None and self.landing.get(key) is block:
                    del self.landing[key]

    def free(self, request: Request) -> None:
        self._drop_landing(request.sequence_id)
        for table in self.req_blocks.pop(request.sequence_id, ()):
            self.pool.free(block for block in reversed(table) if block is not None)
        self.req_num_cached.pop(request.sequence_id, None)
        self.req_num_dropped.pop(request.sequence_id, None)

    def forget(self, request: Request) -> None:
        """Drop the per-request hash memo once a request is finished for good."""
        self.free(request)
        self.req_hashes.pop(request.sequence_id, None)

    def _num_blocks_needed(self, request: Request, num_new_tokens: int,
                           computed: CachedPrefix | None) -> int:
        tables = self.req_blocks.get(request.sequence_id)
        num_hit_tokens = 0 if computed is None else computed.num_blocks * self.block_size
        num_tokens = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_needed = -(-num_tokens // self.block_size)
        total = 0
        for group in range(self.num_groups):
            held = 0 if tables is None else len(tables[group])
            hits = () if computed is None else computed.blocks[group]
            total += max(0, num_needed - held - len(hits))
            # A hit on a block nobody references takes it out of the free queue too.
            total += sum(1 for block in hits if block is not None and block.ref_cnt == 0)
        return total

    def _hashes(self, request: Request) -> list[BlockHash]:
        hashes = self.req_hashes.setdefault(request.sequence_id, [])
        num_full = request.num_tokens // self.block_size
        tokens = request.all_token_ids
        while len(hashes) < num_full:
            start = len(hashes) * self.block_size
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tokens[start:start + self.block_size],
                                     request.cache_key))
        return hashes

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        num_full = min(num_tokens, request.num_tokens) // self.block_size
        first = self.req_num_cached.get(request.sequence_id, 0)
        if num_full <= first:
            return
        hashes = self._hashes(request)
        for group, table in enumerate(self.req_blocks[request.sequence_id]):
            for index in range(first, num_full):
                block = table[index]
                if block is not None:  # (a block freed out of its window before it filled)
                    self.pool.cache_block(block, hashes[index], group)
        self.req_num_cached[request.sequence_id] = num_full
