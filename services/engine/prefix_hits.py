"""The longest cached prefix a request can reuse when its KV lives in groups (kv_groups.py).

A full-attention group needs every block of the prefix; a window group needs only the blocks its
window reaches from the first token computed after the prefix. So a prefix of k blocks is usable
when each full group holds blocks [0, k) and each window group the blocks [in_window(k), k).
A window group's usable lengths are not downward closed (a shorter prefix reaches blocks further
back), so each group in turn cuts the length to its longest usable one within it, until no group
cuts it further.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvrelay.engine.block_pool import BlockHash, KVBlock

# (block hash, group) -> the cached block of that group, or None
Finder = Callable[[BlockHash, int], "KVBlock | None"]


@dataclass(slots=True)
class CachedPrefix:
    """A request's first `num_blocks` blocks found cached: per group, one entry per block
    (None: out of the group's window, not needed)."""
    blocks: list[list[KVBlock | None]]
    num_blocks: int

    @classmethod
    def none(cls, num_groups: int) -> "CachedPrefix":
        return cls([[] for _ in range(num_groups)], 0)


def first_in_window(num_tokens: int, window: int, block_size: int) -> int:
    """The first block any query after `num_tokens` computed tokens may read in a group with
    this window (0: full attention, every block). Blocks before it lie wholly before
    num_tokens - window: the next query (position num_tokens) sees keys from
    num_tokens - window + 1 on, and later ones later still."""
    if not window:
        return 0
    return max(0, num_tokens - window) // block_size


def longest_prefix(hashes: list[BlockHash], windows: tuple[int, ...], block_size: int,
                   find: Finder) -> CachedPrefix:
    """The longest prefix of `hashes` (chained block hashes) every group can reuse."""
    found: list[dict[int, KVBlock | None]] = [{} for _ in windows]

    def cached(group: int, index: int) -> KVBlock | None:
        memo = found[group]
        if index not in memo:
            memo[index] = find(hashes[index], group)
        return memo[index]

    length = len(hashes)
    while True:
        cut = length
        for group, window in enumerate(windows):
            cut = _usable(cut, window, block_size, lambda index: cached(group, index))
        if cut == length:
            break
        length = cut
    blocks = [[cached(group, index) if index >= first_in_window(length * block_size, window,
                                                                 block_size) else None
               for index in range(length)] for group, window in enumerate(windows)]
    return CachedPrefix(blocks, length)


def _usable(length: int, window: int, block_size: int,
            cached: Callable[[int], KVBlock | None]) -> int:
    """The longest prefix of at most `length` blocks that one group holds what it needs of."""
    if not window:  # every block from the first: the leading run
        return next((index for index in range(length) if cached(index) is None), length)
    while length > 0:
        first = first_in_window(length * block_size, window, block_size)
        missing = next((index for index in range(length - 1, first - 1, -1)
                        if cached(index) is None), None)
        if missing is None:
            return length
        length = missing  # any usable prefix ending past the miss would need it
    return 0
