"""Obviously-correct paged attention: one sequence at a time, explicit fp32 softmax.

This is the spec every other path is tested against. Per query at absolute position i and key
at position j, with scale, an optional sliding window W (meta.window) and soft cap c:
  score = scale * q.k; with c > 0: score = c * tanh(score / c) (Gemma 2's logit soft-capping,
  applied before the mask as transformers' eager attention does);
  K and V of an 8-bit cache are its rows dequantized (kernels/kv_quant.py);
  the key is visible iff j <= i and, with W > 0, j > i - W (W keys including its own, Hugging
  Face's `sliding_window`); the softmax runs over the visible keys in fp32.
"""
from __future__ import annotations

import torch

from kvrelay.kernels.kv_quant import as_float_rows
from kvrelay.kernels.metadata import AttentionMetadata
from kvrelay.kernels.sliding_window import first_visible_key


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_q_heads, head_dim]
    soft_cap: float = 0.0,
) -> torch.Tensor:
    if out is None:
        out = torch.empty_like(query)
    cu_seqlens_q = meta.cu_seqlens_q.tolist()
    seq_lens = meta.seq_lens.tolist()
    for seq, seq_len in enumerate(seq_lens):
        start, end = cu_seqlens_q[seq], cu_seqlens_q[seq + 1]
        if end == start:
            continue
        context_len = seq_len - (end - start)
        first_key = first_visible_key(context_len, meta.window)
        keys = as_float_rows(gather_sequence(k_cache, meta.block_tables[seq], seq_len, first_key),
                             torch.float32)
        values = as_float_rows(gather_sequence(v_cache, meta.block_tables[seq], seq_len, first_key),
                               torch.float32)
        out[start:end] = causal_attention(query[start:end], keys, values, context_len - first_key, scale,
                                          meta.window, soft_cap)
    return out



def gather_sequence(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks_per_seq] int32
    seq_len: int,
    first_key: int = 0,
) -> torch.Tensor:  # [seq_len - first_key, num_kv_heads, head_dim], keys first_key .. seq_len - 1
    block_size = cache.shape[1]
    positions = torch.arange(first_key, seq_len, device=cache.device)
    blocks = block_table.long()[positions // block_size]
    return cache[blocks, positions % block_size]


def causal_attention(
    query: torch.Tensor,  # [query_len, num_q_heads, head_dim]
    keys: torch.Tensor,  # [num_keys, num_kv_heads, head_dim], the last of them the last query's
    values: torch.Tensor,  # [num_keys, num_kv_heads, head_dim]
    context_len: int,  # keys before the first query's own (positions relative to keys[0])
    scale: float,
    window: int = 0,
    soft_cap: float = 0.0,
) -> torch.Tensor:  # [query_len, num_q_heads, head_dim]
    group_size = query.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group_size, dim=1)
    values = values.float().repeat_interleave(group_size, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), keys) * scale
    if soft_cap > 0:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    query_positions = context_len + torch.arange(query.shape[0], device=query.device)
    key_positions = torch.arange(keys.shape[0], device=query.device)
    hidden = key_positions[None, :] > query_positions[:, None]
    if window > 0:
        hidden |= key_positions[None, :] <= query_positions[:, None] - window
    scores = scores.masked_fill(hidden[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values).to(query.dtype)
