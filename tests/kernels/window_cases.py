"""Batches for the sliding-window and soft-cap tests, and the block-table poisoning that checks
the contract a hybrid KV cache relies on: entries wholly before a sequence's window are never
read (the cache frees those blocks and leaves stale ids there)."""
from __future__ import annotations

import pytest
import torch

from kvrelay.kernels.attention_reference import paged_attention_reference
from kvrelay.kernels.metadata import AttentionMetadata, build_attention_metadata
from kvrelay.kernels.sliding_window import first_visible_key
from tests.kernels.paged_batch import PagedBatch, make_paged_batch

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}

# (id, query_lens, context_lens, block_size, num_kv_heads, group_size, head_dim)
_CASES = [
    ("decode", [1, 1, 1, 1], [0, 15, 40, 90], 16, 2, 3, 64),
    # a verify step: runs of 1 + drafts decode rows (17: the most the plan takes as rows)
    ("speculative", [5, 1, 3, 17], [40, 7, 13, 100], 16, 2, 3, 64),
    ("prefill", [18, 33, 70], [0, 0, 0], 16, 1, 8, 128),
    ("prefix-hit", [40, 25], [64, 5], 32, 2, 1, 64),
    ("chunked", [70, 19], [130, 48], 8, 1, 4, 64),
    ("mixed", [1, 64, 3, 1, 21], [40, 0, 17, 0, 80], 16, 2, 3, 64),
]
WINDOW_CASES = [pytest.param(*case[1:], id=case[0]) for case in _CASES]
# The cases with a sequence whose context reaches a block past POISON_WINDOW keys: they have
# block-table entries wholly before the window to poison.
POISON_WINDOW = 20
POISON_CASES = [pytest.param(*case[1:], id=case[0]) for case in _CASES if case[0] != "prefill"]
WINDOW_ARGS = "query_lens, context_lens, block_size, num_kv_heads, group_size, head_dim"

# none, a single key, shorter than the sequences (block-aligned and not), longer than all of them
WINDOWS = [0, 1, 8, 37, 4096]
SOFT_CAPS = [0.0, 5.0]
# Queries scaled up where the cap is on, so that most scores reach its bend (|s| ~ cap).
CAPPED_QUERY_GAIN = 4.0


def fresh_seed() -> int:
    return int(torch.randint(0, 2**31 - 1, ()))


def window_batch(query_lens, context_lens, block_size, num_kv_heads, group_size, head_dim, *, window,
                 soft_cap, dtype=torch.float32, seed=None, **kwargs) -> PagedBatch:
    """Fresh random inputs (every run) with the window in the metadata."""
    batch = make_paged_batch(query_lens, context_lens, block_size, num_kv_heads * group_size, num_kv_heads,
                             head_dim, fresh_seed() if seed is None else seed, dtype=dtype, window=window,
                             **kwargs)
    if soft_cap:
        batch.query.mul_(CAPPED_QUERY_GAIN)
    return batch


def reference(batch: PagedBatch, soft_cap: float, meta: AttentionMetadata | None = None) -> torch.Tensor:
    return paged_attention_reference(batch.query, batch.k_cache, batch.v_cache, meta or batch.meta, batch.scale,
                                     soft_cap=soft_cap)


def max_error(out: torch.Tensor, expected: torch.Tensor) -> float:
    assert not out.isnan().any(), "a row was not written, or read a slot it must not"
    return (out.float() - expected.float()).abs().max().item()


def stale_blocks(meta: AttentionMetadata) -> list[tuple[int, int]]:
    """(sequence, table column) of every block wholly before the sequence's first visible key."""
    query_lens = (meta.cu_seqlens_q[1:] - meta.cu_seqlens_q[:-1]).tolist()
    stale = []
    for seq, (query_len, seq_len) in enumerate(zip(query_lens, meta.seq_lens.tolist())):
        first_key = first_visible_key(seq_len - query_len, meta.window)
        stale += [(seq, column) for column in range(first_key // meta.block_size)]
    return stale


def nan_block(meta: AttentionMetadata, num_blocks: int) -> int:
    """A block that no sequence's keys lie in: never written, so NaN in the test batches."""
    used = set()
    for seq, seq_len in enumerate(meta.seq_lens.tolist()):
        used.update(meta.block_tables[seq, : -(-seq_len // meta.block_size)].tolist())
    return next(block for block in range(num_blocks) if block not in used)


def poisoned_meta(batch: PagedBatch, poison: str) -> AttentionMetadata:
    """The batch's metadata, planned afresh from a table whose stale entries point at a block of
    NaN ("nan-block") or far outside the cache ("out-of-range", where a read would crash or be
    refused)."""
    meta = batch.meta
    stale = stale_blocks(meta)
    assert stale, "the case has no block before its window: nothing would be checked"
    num_blocks = batch.k_cache.shape[0]
    bad_id = nan_block(meta, num_blocks) if poison == "nan-block" else num_blocks + 1000
    tables = meta.block_tables.clone()
    for seq, column in stale:
        tables[seq, column] = bad_id
    return build_attention_metadata(meta.cu_seqlens_q, meta.seq_lens, tables, meta.block_size, window=meta.window)
