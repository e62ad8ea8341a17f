"""A large CPU step's rows rounded up to a bucket, so that oneDNN's matmuls see few row counts.

oneDNN builds (JIT-compiles) a kernel for every new row count M of a packed bf16 matmul and
caches it after: for the default model's four layer shapes that cost ~45 ms at M ~2,000 and ~14
ms at M = 170, once per M (benchmarks/HISTORY.md, session 28). A serving step's M is the sum of
its prompts' chunks, new nearly every step, so every prefill step paid it again: ~15% of a
12-prompt step, more of a short one. Rounded up to a bucket, M takes a few dozen values up to
the token budget, each compiled once.

The buckets are 1/16 to 1/32 of an octave wide (16 rows up to 512, then 32, 64, ...), so the
padding costs at most ~6% of a step's rows above 256 tokens. A pad row is token 0 at position 0
with no KV slot (-1): the store skips it, it is no sequence's query (attention leaves its row
zero, kernels/attention_cpu.py), and no logits are read from it.
"""
from __future__ import annotations

PAD_TOKEN_ID = 0
PAD_SLOT = -1  # the KV store skips negative slots
MIN_GRAIN = 16


def bucket_grain(num_tokens: int) -> int:
    """Rows per bucket around num_tokens: 16 up to 512, then doubling with every octave."""
    grain = MIN_GRAIN
    while grain * 32 < num_tokens:
        grain *= 2
    return grain


def padded_rows(num_tokens: int, pad_from_rows: int | None) -> int:
    """num_tokens rounded up to its bucket where the step reaches oneDNN (pad_from_rows or
    more rows); unchanged below, or where nothing pads (None)."""
    if pad_from_rows is None or num_tokens < pad_from_rows:
        return num_tokens
    grain = bucket_grain(num_tokens)
    return -(-num_tokens // grain) * grain


def bucket_sizes(pad_from_rows: int | None, max_rows: int) -> list[int]:
    """Every padded row count a step of pad_from_rows to max_rows rows can have, in order;
    [] where nothing pads."""
    if pad_from_rows is None or max_rows < pad_from_rows:
        return []
    return sorted({padded_rows(rows, pad_from_rows) for rows in range(pad_from_rows, max_rows + 1)})
