"""Obviously-correct paged attention: one sequence at a time, explicit fp32 softmax."""
from __future__ import annotations

import torch

from kvrelay.kernels.metadata import AttentionMetadata


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_dim]
    k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    meta: AttentionMetadata,
    scale: float,
    out: torch.Tensor | None = None,  # [num_tokens, num_q_heads, head_dim]
) -> torch.Tensor:
    if out is None:
        out = torch.empty_like(query)
    cu_seqlens_q = meta.cu_seqlens_q.tolist()
    seq_lens = meta.seq_lens.tolist()
    for seq, seq_len in enumerate(seq_lens):
        start, end = cu_seqlens_q[seq], cu_seqlens_q[seq + 1]
        if end == start:
            continue
        keys = gather_sequence(k_cache, meta.block_tables[seq], seq_len)
        values = gather_sequence(v_cache, meta.block_tables[seq], seq_len)
        out[start:end] = causal_attention(query[start:end], keys, values, seq_len - (end - start), scale)
    return out


def gather_sequence(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [max_blocks_per_seq] int32
    seq_len: int,
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    block_size = cache.shape[1]
    positions = torch.arange(seq_len, device=cache.device)
    blocks = block_table.long()[positions // block_size]
    return cache[blocks, positions % block_size]


def causal_attention(
    query: torch.Tensor,  # [query_len, num_q_heads, head_dim]
    keys: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    values: torch.Tensor,  # [seq_len, num_kv_heads, head_dim]
    context_len: int,
    scale: float,
) -> torch.Tensor:  # [query_len, num_q_heads, head_dim]
    group_size = query.shape[1] // keys.shape[1]
    keys = keys.float().repeat_interleave(group_size, dim=1)
    values = values.float().repeat_interleave(group_size, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query.float(), keys) * scale
    query_positions = context_len + torch.arange(query.shape[0], device=query.device)
    key_positions = torch.arange(keys.shape[0], device=query.device)
    future = key_positions[None, :] > query_positions[:, None]
    scores = scores.masked_fill(future[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), values).to(query.dtype)
