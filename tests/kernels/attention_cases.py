"""Batch shapes every attention implementation is checked on.

Each case: (id, query_lens, context_lens, block_size, num_kv_heads, group_size, head_dim).
"""
import pytest

_CASES = [
    # pure decode
    ("decode-bs16-g1-d64", [1, 1, 1], [15, 16, 40], 16, 2, 1, 64),
    ("decode-bs32-g3-d64", [1, 1], [31, 70], 32, 3, 3, 64),
    ("decode-bs16-g8-d128", [1, 1, 1], [5, 33, 64], 16, 1, 8, 128),
    ("decode-first-token", [1], [0], 16, 1, 1, 64),
    ("decode-long-bs32-g3", [1, 1], [100, 3], 32, 1, 3, 64),
    # pure prefill
    ("prefill-bs16-g1-d64", [17, 9], [0, 0], 16, 2, 1, 64),
    ("prefill-bs32-g3-d128", [33, 5], [0, 0], 32, 1, 3, 128),
    ("prefill-bs16-g8-d64", [20], [0], 16, 1, 8, 64),
    ("prefill-many-tiles-g1", [70], [0], 16, 1, 1, 64),
    # chunked prefill: earlier context in the cache plus new tokens
    ("chunked-bs16-g3-d64", [12, 7], [20, 16], 16, 2, 3, 64),
    ("chunked-bs32-g1-d128", [40], [25], 32, 1, 1, 128),
    ("chunked-bs16-g8-d128", [6, 19], [48, 3], 16, 1, 8, 128),
    ("chunked-block-aligned", [16], [16], 16, 1, 3, 64),
    ("chunked-many-tiles-g1", [70], [5], 16, 1, 1, 64),
    # mixed decode and prefill rows in one batch
    ("mixed-bs16-g3-d64", [1, 13, 1, 7], [29, 0, 3, 18], 16, 1, 3, 64),
    ("mixed-bs32-g8-d64", [1, 1, 24], [63, 10, 9], 32, 1, 8, 64),
    ("mixed-bs16-g1-d128", [5, 1, 1], [0, 47, 16], 16, 2, 1, 128),
    ("mixed-bs32-g3-d128", [1, 9, 1, 2], [33, 40, 0, 5], 32, 2, 3, 128),
    ("mixed-speculative-g8", [3, 2, 4], [10, 30, 0], 16, 1, 8, 64),
    ("mixed-empty-query-row", [3, 0, 1], [2, 5, 9], 16, 1, 3, 64),
    # layouts off the beaten path
    ("mixed-bs8", [1, 11], [20, 6], 8, 1, 3, 64),
    ("mixed-d80-padded-dim", [1, 6], [17, 9], 16, 1, 3, 80),
]

ATTENTION_CASES = [pytest.param(*case[1:], id=case[0]) for case in _CASES]
ATTENTION_ARGS = "query_lens, context_lens, block_size, num_kv_heads, group_size, head_dim"


def case_seed(query_lens, context_lens, block_size, num_kv_heads, group_size, head_dim) -> int:
    """A different seed per case (stable across runs so a failure can be replayed)."""
    key = (tuple(query_lens), tuple(context_lens), block_size, num_kv_heads, group_size, head_dim)
    return sum(ord(ch) * (i + 1) for i, ch in enumerate(repr(key))) % (2**31)
