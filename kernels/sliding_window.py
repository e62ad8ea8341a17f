"""The sliding window's rule in one place: with window W > 0, the query at absolute position i
sees key j iff i - W < j <= i (W keys including its own: Hugging Face's `sliding_window`);
W = 0 is full causal attention. Every kernel starts reading at first_visible_key, so block-table
entries before it are never looked at (a hybrid cache frees those blocks)."""
from __future__ import annotations


def first_visible_key(first_query_position: int, window: int) -> int:
    """The earliest key that a query at this position, or any later one, sees."""
    return max(0, first_query_position - window + 1) if window > 0 else 0


def limits_keys(window: int, seq_len: int) -> bool:
    """Whether the window hides any key of a sequence of seq_len keys from its queries: a
    window of at least seq_len keys is full causal attention there."""
    return 0 < window < seq_len
